"""A preallocated, slot-indexed KV cache: the one static shape every backend compiles against.

Layout per layer: (B * H_kv * S, hd), the rows of a (B, H_kv, S, hd) tensor, which is the layout attention
reads, so no step transposes or copies a cache. Row (b * H_kv + h) * S + slot holds head h of slot `slot`
of batch row b: one `index_copy_` along dim 0 writes a different slot per batch row (rows of a batch may
have accepted different lengths). Nothing is ever reallocated: stale slots stay in place and are masked out.
"""
from __future__ import annotations

import torch
from torch import nn


def slot_rows(slots: torch.Tensor, n_kv_head: int, max_len: int) -> torch.Tensor:
    """(B, T) per-row slot indices -> (B*H_kv*T,) rows of a (B*H_kv*S, hd) cache, ordered (b, h, t).
    The one definition of the layout, shared by the in-place cache and the ONNX export's functional one."""
    batch = slots.shape[0]
    b = torch.arange(batch, device=slots.device)[:, None, None]
    h = torch.arange(n_kv_head, device=slots.device)[None, :, None]
    return ((b * n_kv_head + h) * max_len + slots[:, None, :]).reshape(-1)


class StaticKVCache(nn.Module):
    def __init__(self, n_layer: int, batch: int, max_len: int, n_kv_head: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, spare: int = 0):
        """max_len slots per row that steps write and attend, and `spare` more that none ever does: with one,
        the slots a step attends are always a proper prefix of the cache, so a graph compiled with that length
        dynamic never meets the whole cache (where torch.compile specializes a contiguous view into a graph of
        its own; lantern.backends.torch_graph's bounded attention)."""
        super().__init__()
        self.n_layer, self.batch, self.max_len = n_layer, batch, max_len + spare
        self.n_kv_head, self.head_dim = n_kv_head, head_dim
        shape = (batch * n_kv_head * self.max_len, head_dim)
        for i in range(n_layer):
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def flat(self, slots: torch.Tensor) -> torch.Tensor:
        """(B, T) per-row slot indices -> (B*H_kv*T,) row indices into every layer's cache."""
        return slot_rows(slots, self.n_kv_head, self.max_len)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, flat_slots: torch.Tensor, live: int):
        """Write k, v (B, T, H_kv, hd) at flat_slots; return the cache's first `live` slots (the step's mask may
        cover only the first slots: the rest are never attended) as (B, H_kv, live, hd) views. The cache keeps
        its own dtype whatever autocast computed k and v in."""
        kc, vc = getattr(self, f"k{layer}"), getattr(self, f"v{layer}")
        kc.index_copy_(0, flat_slots, k.transpose(1, 2).reshape(-1, self.head_dim).to(kc.dtype))
        vc.index_copy_(0, flat_slots, v.transpose(1, 2).reshape(-1, self.head_dim).to(vc.dtype))
        shape = (self.batch, self.n_kv_head, self.max_len, self.head_dim)
        return kc.view(shape).narrow(2, 0, live), vc.view(shape).narrow(2, 0, live)

    def compact(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy slots src -> dst, both (B, A), in every layer (gather first, so overlaps are safe)."""
        src, dst = self.flat(src_slots), self.flat(dst_slots)
        for i in range(self.n_layer):
            for name in (f"k{i}", f"v{i}"):
                buf = getattr(self, name)
                buf.index_copy_(0, dst, buf.index_select(0, src))

    @property
    def dtype(self) -> torch.dtype:
        return self.k0.dtype

    @property
    def device(self) -> torch.device:
        return self.k0.device

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers() if b.is_floating_point())
