"""Logits -> target distribution: classifier-free guidance, then temperature, top-k, top-p."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """greedy=True takes the argmax (temperature etc. are then ignored for the choice itself)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    cfg_scale: float = 1.0  # 1 = no guidance, and no unconditional rows

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature {self.temperature} must be > 0 (use greedy for argmax)")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1]")
        if self.cfg_scale < 1:
            raise ValueError(f"cfg_scale {self.cfg_scale} must be >= 1 (1 turns guidance off)")

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale > 1.0

    @property
    def rows_per_image(self) -> int:
        return 2 if self.use_cfg else 1


def combine_cfg(logits: torch.Tensor, scale: float, use_cfg: bool) -> torch.Tensor:
    """logits (R, ..., V) with rows [cond; uncond] -> (R/2, ..., V): u + s * (c - u)."""
    if not use_cfg:
        return logits
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + scale * (cond - uncond)


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) guided logits -> probabilities after temperature, top-k and top-p (float32)."""
    x = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        # drop a token once the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(..., V) -> (...) one draw per row."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """(V,) -> (k,) distinct tokens in draw order (successive draws from the renormalised remainder)."""
    return torch.multinomial(probs, k, replacement=False, generator=generator)
