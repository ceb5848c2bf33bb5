"""EAGLE-1 style drafter: fc([emb(x_{t+1}); f_t]) -> one LlamaGen decoder layer -> predicted f_{t+1}.

The drafter owns only `fc` and `layer`; token embedding, RoPE table, final head and null condition are the
target's (frozen), passed in at call time, so a drafter checkpoint holds nothing it could disagree on.
Position convention: the pair (f_t, x_{t+1}) sits at x_{t+1}'s sequence position, and its output is the
drafter's guess of f_{t+1}, whose logits predict x_{t+2}.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lantern.config import GPTConfig
from lantern.kv_cache import StaticKVCache
from lantern.models.gpt import GPT, TransformerBlock, attention_bias


class Drafter(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=True)
        self.layer = TransformerBlock(cfg, layer_id=0)

    def forward(self, target: GPT, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: Optional[torch.Tensor] = None, cache: Optional[StaticKVCache] = None,
                slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens, positions (B, T); features (B, T, D); mask (B, T, S) or None for causal over T.
        Returns predicted features (B, T, D), to be read out by `target.head`."""
        x = self.fc(torch.cat([target.tok_embeddings(tokens), features.to(self.fc.weight.dtype)], dim=-1))
        rope = target.rope_at(positions)
        flat = cache.flat(slots) if cache is not None else None
        m = attention_bias(mask, x.dtype) if mask is not None else None
        return self.layer(x, rope, m, cache, flat)
