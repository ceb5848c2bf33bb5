"""Deepen a trained target without changing what it computes: every layer becomes two consecutive layers.

Layer i of the source is copied to layers 2i and 2i+1 of the grown model. In the copy at 2i+1 the two
output projections (attention.wo and feed_forward.w2) are zero, so that block adds nothing to the residual
stream: the grown model starts as exactly the source function and training then uses the extra depth.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from lantern.models.config import GPTConfig

LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
RESIDUAL_OUTPUTS = ("attention.wo.weight", "feed_forward.w2.weight")  # what a block adds to the residual


def grown_config(cfg: GPTConfig) -> GPTConfig:
    return dataclasses.replace(cfg, n_layer=2 * cfg.n_layer)


def grow_by_duplication(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GPT state dict with n layers -> one with 2n layers computing the same function (see module doc)."""
    grown = {}
    for key, value in state.items():
        match = LAYER_KEY.match(key)
        if match is None:
            grown[key] = value.clone()
            continue
        index, rest = int(match.group(1)), match.group(2)
        grown[f"layers.{2 * index}.{rest}"] = value.clone()
        duplicate = torch.zeros_like(value) if rest in RESIDUAL_OUTPUTS else value.clone()
        grown[f"layers.{2 * index + 1}.{rest}"] = duplicate
    return grown
