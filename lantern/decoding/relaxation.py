"""Relaxed acceptance over VQ latent neighbours: lantern's bounded relaxed target, and the papers' boost.

Bounded (lantern's default; docs/algorithms.md): before any draw, each node gets a fixed target p_hat that
moves probability from sources z (p(z) > q(z)) to receivers y (q(y) > p(y) > 0) among y's k nearest
codebook neighbours: at most delta in all (LANTERN form) or at most (lam - 1) * p(y) into each y (LANTERN++
form). Exact recursive rejection against p_hat outputs exactly p_hat, so each token's distribution is within
TV(p_hat, p) = the moved mass of the target, recorded per token. For deterministic top-k drafts "q" is the
fixed candidate set (q = 1 on candidates, 0 elsewhere).

Paper (LANTERN / LANTERN++ as published, kept for comparison): per candidate x, p~(x) = p(x) + C_m*(x)
with C_m the mass of x's m nearest neighbours, m* the largest m <= k with C_m <= delta (or (lam-1) p(x)).
Its output distortion is not bounded by delta (docs/algorithms.md says why); never boosts p(x) = 0.
"""
from __future__ import annotations

import torch

from lantern.decoding.sampling import Support


def _scatter_sum(values: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """values, ids (B, M, ...) -> (B, M, V): sum of values per token id."""
    b, m = ids.shape[:2]
    out = torch.zeros(b, m, vocab, dtype=values.dtype, device=values.device)
    return out.scatter_add_(2, ids.reshape(b, m, -1), values.reshape(b, m, -1))


def _gather(dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """dense (B, M, V), ids (B, M, ...) -> dense values at ids, shaped like ids."""
    b, m = ids.shape[:2]
    return dense.gather(2, ids.reshape(b, m, -1)).reshape(ids.shape)


class Neighbourhood:
    """Each code's k nearest codebook neighbours (self excluded): the list `ordered` (V, k) in any integer type
    (a compact one at large V), nearest first,
    and, built on first use, the same sets as a membership bitset (V, ceil(V / 64)) int64 whose row y has
    bit z % 64 of word z // 64 set iff z is among y's neighbours."""

    def __init__(self, ordered: torch.Tensor):
        self.ordered = ordered
        self._bits: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.ordered.shape[1]

    def contains(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z int64 ids (broadcastable) -> bool: z is among y's neighbours."""
        if self._bits is None:
            v, ordered = self.ordered.shape[0], self.ordered.long()  # shifts and scatter need int64, once
            bit = torch.ones_like(ordered) << (ordered % 64)  # a row's ids are distinct: + is |
            self._bits = torch.zeros(v, (v + 63) // 64, dtype=torch.long, device=self.ordered.device)
            self._bits.scatter_add_(1, ordered // 64, bit)
        return ((self._bits[y, z // 64] >> (z % 64)) & 1).bool()


class _SupportSources:
    """Flow sources of a node's receivers as (B, M, K, S) slots, S = K: the node's own support tokens (only
    they have excess), with the slots of non-neighbours reading 0. For supports no wider than k.
    from_support: per-token values (B, M, K) -> per source; at: per-source values read at every receiver's
    slots; per_source: slot values summed per source; to_support: per-source values at the support tokens."""

    def __init__(self, ids: torch.Tensor, near: Neighbourhood):
        self.link = near.contains(ids[..., :, None], ids[..., None, :]).float()  # (B, M, K, K) y -> z

    def from_support(self, values: torch.Tensor) -> torch.Tensor:
        return values  # (B, M, K): one source per support token

    def at(self, values: torch.Tensor) -> torch.Tensor:
        return values[..., None, :] * self.link

    def per_source(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.sum(-2)

    def to_support(self, values: torch.Tensor) -> torch.Tensor:
        return values


class _CodeSources:
    """The same, S = k: receiver y's slots are its k neighbours, sources indexed by code (B, M, V). For
    supports wider than k."""

    def __init__(self, ids: torch.Tensor, near: Neighbourhood, vocab: int):
        self.ids, self.vocab = ids, vocab
        self.nb = near.ordered[ids].long()  # (B, M, K, k)

    def from_support(self, values: torch.Tensor) -> torch.Tensor:
        return _scatter_sum(values, self.ids, self.vocab)

    def at(self, values: torch.Tensor) -> torch.Tensor:
        return _gather(values, self.nb)

    def per_source(self, slots: torch.Tensor) -> torch.Tensor:
        return _scatter_sum(slots, self.nb, self.vocab)

    def to_support(self, values: torch.Tensor) -> torch.Tensor:
        return values.gather(2, self.ids)


def bounded_target(p: Support, q_on_support: torch.Tensor, near: Neighbourhood, vocab: int,
                   delta: float | None, lam: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """p (B, M, K) at M nodes; q_on_support (B, M, K) the draft distribution at p's support tokens (K
    distinct tokens per node); near: the codes' neighbourhoods. Exactly one of delta (LANTERN) / lam
    (LANTERN++). Returns p_hat probs on p's support (B, M, K) and the moved mass TV(p_hat, p) (B, M).
    Receivers read their sources as pairs among the support or through their neighbour lists, whichever is
    narrower: the same flows, up to rounding."""
    ps = p.probs
    excess = (ps - q_on_support).clamp_min(0.0)  # sources
    want = (q_on_support - ps).clamp_min(0.0) * (ps > 0)  # receivers, never a token AR cannot emit
    if lam is not None:
        want = torch.minimum(want, (lam - 1.0) * ps)
    sources = _SupportSources(p.ids, near) if ps.shape[-1] <= near.k else _CodeSources(p.ids, near, vocab)
    excess_s = sources.from_support(excess)
    avail = sources.at(excess_s)  # (B, M, K, S) what each receiver's neighbours could give
    total = avail.sum(-1)
    take = torch.minimum(want, total)  # (B, M, K)
    share = torch.where(total[..., None] > 0, avail / total[..., None].clamp_min(1e-30), 0.0)
    flow = take[..., None] * share  # receiver y <- neighbour z, proportional to z's excess
    demand = sources.per_source(flow)  # asked of each source
    scale = torch.where(demand > 0, (excess_s / demand.clamp_min(1e-30)).clamp(max=1.0), 1.0)
    flow = flow * sources.at(scale)  # no source gives more than its excess
    moved = flow.sum((-1, -2))  # (B, M)
    if delta is not None:
        cut = torch.where(moved > delta, delta / moved.clamp_min(1e-30), 1.0)
        flow, moved = flow * cut[..., None, None], torch.minimum(moved, torch.full_like(moved, delta))
    inflow = flow.sum(-1)
    outflow = sources.to_support(sources.per_source(flow))
    return (ps + inflow - outflow).clamp_min(0.0), moved


def paper_boost(residual_dense: torch.Tensor, original_px: torch.Tensor, x: torch.Tensor, neighbours: torch.Tensor,
                delta: float | None, lam: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The papers' per-candidate rule at candidates x (B, M) against residual_dense (B, M, V).
    Returns (p~(x), boost C_m*(x)), each (B, M); no boost where the original p(x) is 0."""
    px = residual_dense.gather(2, x[..., None])[..., 0]
    cum = _gather(residual_dense, neighbours[x].long()).double().cumsum(-1)  # (B, M, k) C_1..C_k, non-decreasing
    bound = torch.full_like(px, delta).double() if delta is not None else (lam - 1.0) * px.double()
    m = (cum <= bound[..., None]).sum(-1)  # qualifying m form a prefix: m* is their count
    boost = torch.where(m > 0, cum.gather(-1, (m - 1).clamp_min(0)[..., None])[..., 0], 0.0).float()
    boost = torch.where(original_px > 0, boost, 0.0)
    return px + boost, boost
