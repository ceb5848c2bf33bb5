"""The reference AR sampler used by training reports (the product's decoding lives in lantern.decoding).

Plain token-by-token sampling over the target's static KV cache, with CFG, temperature and top-k.
"""
from __future__ import annotations

import torch

from lantern.kv_cache import StaticKVCache
from lantern.models.gpt import GPT


def cfg_logits(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """(2B, V) rows [cond; uncond] -> (B, V) = u + s * (c - u)."""
    c, u = logits.chunk(2)
    return u + scale * (c - u)


def warp_sample(logits: torch.Tensor, temperature: float, top_k: int, g: torch.Generator) -> torch.Tensor:
    """(B, V) -> (B,) sampled ids; temperature 0 means greedy, top_k 0 means no truncation."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=g)[:, 0]


@torch.no_grad()
def sample_ar_simple(target: GPT, class_ids: torch.Tensor, cfg_scale: float = 3.0, temperature: float = 1.0,
                     top_k: int = 0, seed: int = 0) -> torch.Tensor:
    """class_ids (B,) -> codes (B, block_size). CFG doubles the batch to [cond; null] when cfg_scale != 1."""
    cfgm = target.config
    if cfg_scale != 1.0 and not cfgm.has_null_class:
        raise ValueError(f"cfg_scale {cfg_scale} needs a null class; this target has class_dropout_prob 0")
    target.eval()
    g = torch.Generator().manual_seed(seed)
    B, P, L = len(class_ids), cfgm.cls_token_num, cfgm.block_size
    cond = class_ids.long()
    if cfg_scale != 1.0:
        cond = torch.cat([cond, target.null_condition(B)])
    R, S = len(cond), P + L
    dtype = target.tok_embeddings.weight.dtype
    cache = StaticKVCache(cfgm.n_layer, R, S, cfgm.kv_heads, cfgm.head_dim, dtype, "cpu")
    causal = torch.ones(S, S, dtype=torch.bool).tril()  # row p: slots 0..p
    pos = torch.arange(P).expand(R, -1)
    hidden = target.forward_cached(target.embed_condition(cond), pos, causal[:P][None].expand(R, -1, -1),
                                   cache, pos)
    out = torch.empty(B, L, dtype=torch.long)
    for t in range(L):
        logits = target.head(hidden[:, -1])  # (R, V)
        if cfg_scale != 1.0:
            logits = cfg_logits(logits, cfg_scale)
        out[:, t] = warp_sample(logits, temperature, top_k, g)
        if t + 1 == L:
            break
        tok = out[:, t].repeat(R // B)[:, None]  # (R, 1): both CFG rows see the sampled token
        p = torch.full((R, 1), P + t)
        hidden = target.forward_cached(target.tok_embeddings(tok), p, causal[P + t][None, None].expand(R, 1, -1),
                                       cache, p)
    return out
