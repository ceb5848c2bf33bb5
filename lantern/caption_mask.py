"""LlamaGen's caption mask: in text-to-image, no position attends to a padded caption slot.

LlamaGen (autoregressive/models/generate.py) multiplies its causal mask's caption columns by each caption's mask,
for the conditional and the unconditional (null caption) row of an image alike, and keeps the diagonal (a padded
slot sees itself). Padded slots are the ones LlamaGen zeroed (lantern.text.llamagen_condition), so the mask is read
from the condition itself: a caption slot whose embedding is all zero is padding.

`CaptionMaskedRunner` wraps any backend's Runner and applies this to every mask it is given (masks are inputs of
every backend's steps, so no backend changes). The drafter's masks are left alone: lantern's drafters never
cover the caption, and LANTERN's t2i drafters read it unmasked, as LANTERN feeds them.
"""
from __future__ import annotations

import torch

from lantern.backends.base import Runner, StepOutput


def caption_slots_visible(captions: torch.Tensor) -> torch.Tensor:
    """(B, P, C) caption conditions -> (B, P) bool: True where a slot holds a token (not all-zero padding)."""
    return captions.ne(0).any(-1)


class CaptionMaskedRunner:
    """`runner`, with every target mask also hiding each row's padded caption slots. visible (rows, P) bool."""

    def __init__(self, runner: Runner, visible: torch.Tensor):
        self._runner = runner
        rows, p = visible.shape
        keys = torch.ones(rows, runner.spec.max_len, dtype=torch.bool)
        keys[:, :p] = visible
        self._keys = keys.to(runner.device)  # (rows, S)
        self._own = torch.eye(p, runner.spec.max_len, dtype=torch.bool, device=runner.device)  # (P, S) diagonal

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def _hide(self, mask: torch.Tensor) -> torch.Tensor:
        return (mask & self._keys[:, None, : mask.shape[-1]]).contiguous()

    def prefill(self, cond: torch.Tensor, mask: torch.Tensor) -> StepOutput:
        own = self._own[None, : mask.shape[1], : mask.shape[-1]]
        return self._runner.prefill(cond, (self._hide(mask) | own).contiguous())

    def verify(self, tokens, positions, slots, mask) -> StepOutput:
        return self._runner.verify(tokens, positions, slots, self._hide(mask))
