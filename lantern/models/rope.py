"""2D rotary position embedding, laid out exactly as LlamaGen's `precompute_freqs_cis_2d`."""
from __future__ import annotations

import torch

from lantern.models.kernels import fused_kernels


def rope_table_2d(grid_size: int, head_dim: int, base: float, prefix_len: int) -> torch.Tensor:
    """(prefix_len + grid_size**2, head_dim // 2, 2) cos/sin rows; prefix rows are all zero.

    The first half of the rotary pairs encodes the row, the second half the column. Zero rows for the
    prefix zero q and k of the condition tokens, as LlamaGen does, so real checkpoints give equal logits.
    """
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))  # (hd/4,)
    t = torch.arange(grid_size, dtype=torch.float32)
    freqs = torch.outer(t, freqs)  # (g, hd/4)
    grid = torch.cat(
        [freqs[:, None, :].expand(-1, grid_size, -1), freqs[None, :, :].expand(grid_size, -1, -1)], dim=-1
    )  # (g, g, hd/2)
    table = torch.stack([torch.cos(grid), torch.sin(grid)], dim=-1).flatten(0, 1)  # (g*g, hd/2, 2)
    return torch.cat([torch.zeros(prefix_len, half, 2), table])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, hd); rope: (B, T, hd/2, 2). Rotation in float32, result in x's dtype: each (even, odd) pair
    of x becomes (x0 cos - x1 sin, x1 cos + x0 sin), the complex product (x0 + i x1)(cos + i sin)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, T, H, hd/2, 2)
    r = rope.float()[:, :, None]  # (B, T, 1, hd/2, 2)
    if fused_kernels(x):
        out = torch.view_as_real(torch.view_as_complex(xs) * torch.view_as_complex(r.contiguous()))
    else:
        out = torch.stack([xs[..., 0] * r[..., 0] - xs[..., 1] * r[..., 1],
                           xs[..., 1] * r[..., 0] + xs[..., 0] * r[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers rotary embedding at (B, T) positions -> cos, sin (B, T, 1, hd) in `dtype`, computed in fp32
    as transformers does (inv_freq: its (hd/2,) frequencies; scaling: its attention_scaling)."""
    freqs = positions[..., None].float() * inv_freq  # (B, T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
