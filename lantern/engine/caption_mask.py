"""The caption mask of text-to-image: no image token attends to a padded caption slot; what a padded slot itself
attends differs by convention ("llamagen": only itself; "lantern": LANTERN's additive bf16 mask, an average of the
earlier padded slots), so only the features AT padded slots differ, which only a drafter reading the caption sees
(docs/models.md, "Which caption features a drafter reads"). Padded slots are the ones LlamaGen zeroed
(lantern.models.text.llamagen_condition), so the mask is read from the condition itself.

`CaptionMaskedRunner` wraps any backend's Runner and applies this to every mask it is given (masks are inputs of
every backend's steps, so no backend changes). The drafter's masks are left alone: lantern's drafters never
cover the caption, and LANTERN's t2i drafters read it unmasked, as LANTERN feeds them.
"""
from __future__ import annotations

from typing import Optional

import torch

from lantern.backends.base import Runner, StepOutput
from lantern.models.drafter import check_caption_mask


def caption_slots_visible(captions: torch.Tensor) -> torch.Tensor:
    """(B, P, C) caption conditions -> (B, P) bool: True where a slot holds a token (not all-zero padding)."""
    return captions.ne(0).any(-1)


def drafter_caption_mask(drafter) -> str:
    """The convention the caption features a drafter reads were computed with: its own (`Drafter.caption_mask`),
    LlamaGen's for no drafter or one that records none (lantern's drafters start after the caption, whose last
    slot is never padding, so they read the same features under both)."""
    return getattr(drafter, "caption_mask", None) or "llamagen"


def prefill_caption_mask(mask: torch.Tensor, keys: torch.Tensor, convention: str) -> torch.Tensor:
    """mask (rows, T, S) the prefill's causal mask, keys (rows, S) bool the slots that are not padding ->
    the mask under `convention` (lantern.models.drafter.CAPTION_MASKS)."""
    hidden = mask & keys[:, None]
    t = mask.shape[1]
    if convention == "llamagen":  # a padded slot still sees itself
        own = torch.eye(t, mask.shape[-1], dtype=torch.bool, device=mask.device)
        return hidden | own[None]
    # LANTERN: a slot that sees no earlier valid slot sees every earlier slot (equal additive-mask scores)
    return torch.where(hidden.any(-1, keepdim=True), hidden, mask)


class CaptionMaskedRunner:
    """`runner`, with every target mask also hiding each row's padded caption slots. visible (rows, P) bool;
    convention (lantern.models.drafter.CAPTION_MASKS): what a padded slot attends at prefill (the features a
    drafter reads there)."""

    def __init__(self, runner: Runner, visible: torch.Tensor, convention: Optional[str] = None):
        self._runner = runner
        self._convention = check_caption_mask(convention or "llamagen")
        rows, p = visible.shape
        keys = torch.ones(rows, runner.spec.max_len, dtype=torch.bool)
        keys[:, :p] = visible
        self._keys = keys.to(runner.device)  # (rows, S)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def prefill(self, cond: torch.Tensor, mask: torch.Tensor) -> StepOutput:
        keys = self._keys[:, : mask.shape[-1]]
        return self._runner.prefill(cond, prefill_caption_mask(mask, keys, self._convention).contiguous())

    def verify(self, tokens, positions, slots, mask) -> StepOutput:
        return self._runner.verify(tokens, positions, slots, (mask & self._keys[:, None, :mask.shape[-1]]).contiguous())
