"""What the transformers families' targets (lantern.models.janus, lantern.models.chameleon) share: their static
shape, and their language model run over lantern's static KV cache (the layers' own projections, norms and MLPs,
transformers' RoPE at explicit positions), held by reference."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lantern.models.gpt import attention_bias
from lantern.models.kv_cache import StaticKVCache
from lantern.models.placement import placed_copy
from lantern.models.rope import rope_cos_sin

STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # rope types whose frequencies do not depend on length


@dataclass(frozen=True)
class PromptShape:
    """A family target's lantern.models.family.TargetShape for one prompt length."""

    family: str
    cls_token_num: int  # the prompt's tokens, the begin-image token included
    block_size: int
    grid_size: int
    vocab_size: int  # image codes
    n_layer: int
    n_head: int
    kv_heads: int
    head_dim: int
    dim: int
    model_type: str = "prompt"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def attention(attn, x: torch.Tensor, cos, sin, bias, cache: StaticKVCache, layer: int, flat, live: int,
              shape: PromptShape, qk_norm: bool = True) -> torch.Tensor:
    """An attention module's projections (with qk_norm, Chameleon's per-head q/k LayerNorms) on x (B, T, D), RoPE,
    then attention over cache layer `layer` (written at `flat`, its first `live` slots read) -> (B, T, D)."""
    B, T, _ = x.shape
    H, Hkv, hd = shape.n_head, shape.kv_heads, shape.head_dim
    q, k = attn.q_proj(x), attn.k_proj(x)
    if qk_norm:
        q, k = attn.q_norm(q.reshape(B * T, H, hd)), attn.k_norm(k.reshape(B * T, Hkv, hd))
    q, k, v = q.view(B, T, H, hd), k.view(B, T, Hkv, hd), attn.v_proj(x).view(B, T, Hkv, hd)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    keys, values = cache.update(layer, k, v, flat, live)  # (B, Hkv, s, hd)
    if H > Hkv:
        keys, values = keys.repeat_interleave(H // Hkv, dim=1), values.repeat_interleave(H // Hkv, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=bias,
                                         scale=attn.scaling)  # (B, H, T, hd)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, H * hd))


class LanguageModelTarget(nn.Module):
    """The language model `lm` (a transformers decoder: embed_tokens, layers, norm, rotary_emb) of a prompt-conditioned
    target; a family says how image tokens go in and out (`embed_tokens`, `head`) and what CFG's row is."""

    qk_norm = False  # per-head q/k LayerNorms (Chameleon)
    swin_norm = False  # Chameleon-30B's layer order: norm after attention and after the MLP

    def __init__(self, lm, shape: PromptShape, bos: int, boi: int, pad: int):
        super().__init__()
        self.config = shape
        self.bos, self.boi, self.pad = bos, boi, pad
        self.embeddings = lm.embed_tokens
        self.layers = lm.layers
        self.norm = lm.norm
        rotary = lm.rotary_emb
        self.rope_scaling = float(rotary.attention_scaling)
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)  # (hd/2,)

    def embed_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """Prompt token rows (B, P) -> (B, P, D)."""
        return self.embeddings(cond)

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) positions -> cos, sin (B, T, 1, hd) in `dtype`."""
        return rope_cos_sin(positions, self.inv_freq, self.rope_scaling, dtype)

    def row_positions(self, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The positions RoPE reads; default: the sequence positions themselves (rows are not padded)."""
        return positions

    def forward_cached(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope_at(self.row_positions(positions, mask), h.dtype)
        flat = cache.flat(slots)
        bias = attention_bias(mask, h.dtype)  # (B, 1, T, s)
        live = mask.shape[-1]
        for i, layer in enumerate(self.layers):
            def attend(x):
                return attention(layer.self_attn, x, cos, sin, bias, cache, i, flat, live, self.config, self.qk_norm)
            if self.swin_norm:
                h = h + layer.input_layernorm(attend(h))
                h = h + layer.post_attention_layernorm(layer.mlp(h))
            else:
                h = h + attend(layer.input_layernorm(h))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def placed(self, device: torch.device, dtype: torch.dtype) -> "LanguageModelTarget":
        """Itself where its weights already are on `device` in `dtype` (frozen: runners never write weights),
        else a converted copy of its modules (the RoPE frequencies stay in fp32)."""
        weights = [t for name, t in itertools.chain(self.named_parameters(), self.named_buffers())
                   if t.is_floating_point() and name != "inv_freq"]
        if all(t.device == device and t.dtype == dtype for t in weights):
            return self.eval().requires_grad_(False)
        return placed_copy(self, device, dtype, keep_fp32=("inv_freq",))
