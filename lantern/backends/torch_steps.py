"""The static steps as small nn.Modules over tensors only, shared by every torch-based backend.

One module per step, so graph modes can capture each once: eager calls them, `cpu-graph`/`cuda-graph`
compile them, the HPU backend wraps them with `wrap_in_hpu_graph`, the ONNX backend exports them.
The KV caches are buffers of the modules and are written in place with `index_copy_`.
"""
from __future__ import annotations

import torch
from torch import nn

from lantern.models.kv_cache import StaticKVCache


class TargetPrefill(nn.Module):
    def __init__(self, target, cache: StaticKVCache):
        super().__init__()
        self.target, self.cache = target, cache
        p = target.config.cls_token_num
        positions = torch.arange(p, device=cache.device)[None].expand(cache.batch, p)
        self.register_buffer("positions", positions.contiguous(), persistent=False)

    def forward(self, cond: torch.Tensor, mask: torch.Tensor):
        """cond (B,) or (B, P, C); mask (B, P, S) -> logits (B, 1, V) at position P-1, hidden (B, P, D)."""
        h = self.target.embed_condition(cond).to(self.cache.dtype)
        hidden = self.target.forward_cached(h, self.positions, mask, self.cache, self.positions)
        return self.target.head(hidden[:, -1:]), hidden


class TargetStep(nn.Module):
    def __init__(self, target, cache: StaticKVCache):
        super().__init__()
        self.target, self.cache = target, cache

    def forward(self, tokens, positions, slots, mask):
        """tokens, positions, slots (B, T); mask (B, T, S) -> logits (B, T, V), hidden (B, T, D)."""
        hidden = self.target.forward_cached(self.target.embed_tokens(tokens), positions, mask,
                                            self.cache, slots)
        return self.target.head(hidden), hidden


class DraftStep(nn.Module):
    def __init__(self, target, drafter, cache: StaticKVCache):
        super().__init__()
        self.target, self.drafter, self.cache = target, drafter, cache

    def forward(self, tokens, features, positions, slots, mask):
        """(feature, token) pairs (B, T) -> logits (B, T, V), predicted features (B, T, D)."""
        feats = self.drafter(self.target, tokens, features, positions, mask, self.cache, slots)
        return self.target.head(feats), feats


class CacheCommit(nn.Module):
    def __init__(self, cache: StaticKVCache):
        super().__init__()
        self.cache = cache

    def forward(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.cache.compact(src, dst)


def make_caches(target, spec, dtype, device, spare: int = 0) -> tuple[StaticKVCache, StaticKVCache | None]:
    """The target's cache and (with draft widths) the drafter's, each with `spare` slots (StaticKVCache)."""
    cfg = target.config
    target_cache = StaticKVCache(cfg.n_layer, spec.batch, spec.max_len, cfg.kv_heads, cfg.head_dim, dtype, device,
                                 spare)
    draft_cache = (StaticKVCache(1, spec.batch, spec.max_len, cfg.kv_heads, cfg.head_dim, dtype, device, spare)
                   if spec.draft_widths else None)
    return target_cache, draft_cache
