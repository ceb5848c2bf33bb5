"""Latent proximity tables: for each VQ code, the other codes ordered by codebook distance (LANTERN)."""
from __future__ import annotations

import torch


def build_proximity_table(codebook: torch.Tensor, k_max: int) -> torch.Tensor:
    """codebook (V, d), the vectors the decoder actually uses -> (V, k) int64 neighbour ids.

    Row x lists n_1(x), n_2(x), ... by ascending Euclidean distance, x itself excluded; k = min(k_max, V-1).
    int64 because gather/index need it (a uint16 table silently breaks gather).
    """
    V = codebook.shape[0]
    if not 0 <= k_max:
        raise ValueError(f"k_max {k_max} must be >= 0")
    k = min(k_max, V - 1)
    e = codebook.double()
    d2 = (e * e).sum(1)[:, None] + (e * e).sum(1)[None, :] - 2.0 * e @ e.T  # (V, V)
    d2.fill_diagonal_(float("inf"))
    # stable sort so that ties are broken by code id, the same on every machine
    order = torch.sort(d2, dim=1, stable=True).indices
    return order[:, :k].to(torch.int64).contiguous()
