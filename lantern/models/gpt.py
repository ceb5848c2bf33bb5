"""LlamaGen-compatible GPT (same module names, so LlamaGen state_dicts load key for key); a
`lantern.models.family.TargetModel` natively.

Two ways in:
- `forward_full(tokens, cond)`: the whole sequence with a causal mask, no cache (training, references).
- `forward_cached(h, positions, mask, cache, slots)`: any T tokens at explicit positions, written into a
  preallocated `StaticKVCache` at explicit slots, attending by an explicit boolean mask over all S slots.
  Prefill, one AR step and a whole token tree are all this one call with a different T.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lantern.models.config import GPTConfig
from lantern.models.kv_cache import StaticKVCache
from lantern.models.kernels import fused_kernels
from lantern.models.placement import placed_copy
from lantern.models.rope import apply_rope, rope_table_2d


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (B, T, S), True = attend -> additive (B, 1, T, S) of 0 / -inf in `dtype`, made once per step
    rather than inside every layer's attention. Softmax gives the same probabilities (adding 0 is exact)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return bias[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # x / rms(x) in float32
        if fused_kernels(x):
            return F.rms_norm(xf, (x.shape[-1],), eps=self.eps).type_as(x) * self.weight
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig, hidden: Optional[int] = None):
        """hidden: the SwiGLU width (default: the config's ffn_hidden)."""
        super().__init__()
        hidden = cfg.ffn_hidden if hidden is None else hidden
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Optional[torch.Tensor],
                cache: Optional[StaticKVCache], flat_slots: Optional[torch.Tensor]) -> torch.Tensor:
        B, T, D = x.shape
        kv = self.n_kv_head * self.head_dim
        qk, v = self.wqkv(x).split([D + kv, kv], dim=-1)
        qk = apply_rope(qk.view(B, T, self.n_head + self.n_kv_head, self.head_dim), rope)  # q and k heads at once
        q, k = qk.split([self.n_head, self.n_kv_head], dim=2)
        v = v.view(B, T, self.n_kv_head, self.head_dim)
        if cache is not None:
            keys, values = cache.update(self.layer_id, k, v, flat_slots, mask.shape[-1])  # (B, Hkv, s, hd)
        else:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, hd)
        rep = self.n_head // self.n_kv_head
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             is_causal=mask is None)  # (B, H, T, hd)
        return self.wo(out.transpose(1, 2).reshape(B, T, D))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_id: int):
        super().__init__()
        self.attention = Attention(cfg, layer_id)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, mask, cache, flat_slots):
        h = x + self.attention(self.attention_norm(x), rope, mask, cache, flat_slots)
        return h + self.feed_forward(self.ffn_norm(h))


class LabelEmbedder(nn.Module):
    def __init__(self, num_classes: int, dim: int, with_null: bool):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(with_null), dim)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(labels).unsqueeze(1)  # (B, 1, D)


class MLP(nn.Module):
    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(d_hidden, d_out, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    def __init__(self, caption_dim: int, dim: int, token_num: int):
        super().__init__()
        self.cap_proj = MLP(caption_dim, dim, dim)
        # A buffer, as in LlamaGen, so its checkpoints' `cls_embedding.uncond_embedding` key loads.
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim ** 0.5)

    def forward(self, caption: torch.Tensor) -> torch.Tensor:
        return self.cap_proj(caption)  # (B, T, C) -> (B, T, D)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        if cfg.model_type == "c2i":
            self.cls_embedding = LabelEmbedder(cfg.num_classes, cfg.dim, cfg.has_null_class)
        else:
            self.cls_embedding = CaptionEmbedder(cfg.caption_dim, cfg.dim, cfg.cls_token_num)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        rope = rope_table_2d(cfg.grid_size, cfg.head_dim, cfg.rope_base, cfg.cls_token_num)
        self.register_buffer("rope", rope, persistent=False)  # (seq_len, hd/2, 2)
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    # --- pieces every backend step is made of -------------------------------------------------
    def embed_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """c2i: class ids (B,) -> (B, 1, D); t2i: caption embeddings (B, P, C) -> (B, P, D)."""
        return self.cls_embedding(cond)

    def null_condition(self, batch: int, device=None) -> torch.Tensor:
        """The CFG unconditional input: the null class id, or LlamaGen's learned null caption."""
        if self.config.model_type == "c2i":
            return torch.full((batch,), self.config.null_class, dtype=torch.long, device=device)
        return self.cls_embedding.uncond_embedding[None].expand(batch, -1, -1).to(device)

    def unconditional(self, cond: torch.Tensor) -> torch.Tensor:
        """The CFG counterpart of condition rows: the null condition, one per row."""
        return self.null_condition(cond.shape[0], cond.device)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def placed(self, device: torch.device, dtype: torch.dtype) -> "GPT":
        """A frozen copy on `device` in `dtype` (the caller's model is never changed); RoPE stays in fp32."""
        return placed_copy(self, device, dtype, keep_fp32=("rope",))  # rotations stay in fp32

    def rope_at(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) sequence positions -> (B, T, hd/2, 2); positions past the last image token are clamped
        (only drafted tree nodes beyond the end of an image land there, and they are never accepted)."""
        return self.rope[positions.clamp(max=self.rope.shape[0] - 1)]

    def forward_cached(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                       cache: StaticKVCache, slots: torch.Tensor) -> torch.Tensor:
        """h (B, T, D) input embeddings; positions, slots (B, T); mask (B, T, s) bool, True = attend, over the
        cache's first s <= S slots (the others are not read). Returns final-normed hidden states (B, T, D)
        (the drafter's features)."""
        rope = self.rope_at(positions)
        flat = cache.flat(slots)
        m = attention_bias(mask, h.dtype)  # (B, 1, T, s)
        for layer in self.layers:
            h = layer(h, rope, m, cache, flat)
        return self.norm(h)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden).float()

    def forward_full(self, tokens: torch.Tensor, cond: torch.Tensor):
        """Teacher-forced pass over [prefix; tokens] with a causal mask.

        tokens (B, L) image tokens, L <= block_size. Returns (logits, hidden), each over all P + L positions;
        logits at position P - 1 + t predict image token t.
        """
        h = torch.cat([self.embed_condition(cond), self.tok_embeddings(tokens)], dim=1)
        B, T, _ = h.shape
        rope = self.rope[:T][None].expand(B, -1, -1, -1)
        for layer in self.layers:
            h = layer(h, rope, None, None, None)
        hidden = self.norm(h)
        return self.head(hidden), hidden
