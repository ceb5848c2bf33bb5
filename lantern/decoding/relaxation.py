"""Relaxed acceptance over VQ latent neighbours: lantern's bounded relaxed target, and the papers' boost.

Bounded (lantern's default; docs/algorithms.md): before any draw, each node gets a fixed target p_hat that
moves probability from sources z (p(z) > q(z)) to receivers y (q(y) > p(y) > 0) among y's k nearest
codebook neighbours: at most delta in all (LANTERN form) or at most (lam - 1) * p(y) into each y (LANTERN++
form). Exact recursive rejection against p_hat outputs exactly p_hat, so each token's distribution is within
TV(p_hat, p) = the moved mass of the target, recorded per token. For deterministic top-k drafts "q" is the
fixed candidate set (q = 1 on candidates, 0 elsewhere), and only the candidates can receive.

Paper (LANTERN / LANTERN++ as published, kept for comparison): per candidate x, p~(x) = p(x) + C_m*(x)
with C_m the mass of x's m nearest neighbours, m* the largest m <= k with C_m <= delta (or (lam-1) p(x)).
Its output distortion is not bounded by delta (docs/algorithms.md says why); never boosts p(x) = 0.

Memory: nothing here is quadratic in the support. The bounded target walks each receiver's neighbour list in
blocks (rows x receivers x neighbours at most WORKSPACE_BYTES at a time) against one dense per-code vector
per row, so a step's extra memory is O(rows * (K + V)) whatever K and k are; its time is O(rows * receivers * k).
"""
from __future__ import annotations

import torch

from lantern.decoding.sampling import Support

WORKSPACE_BYTES = 64 * 2**20  # the most one block of neighbour-list temporaries may hold
_BYTES_PER_PAIR = 16  # a (receiver, neighbour) pair in a block: its int64 id, its compact id, the value read
_BYTES_PER_CODE = 12  # a row's dense per-code scratch: three float32 vectors over the vocabulary


def bounded_target(p: Support, q_on_support: torch.Tensor, neighbours: torch.Tensor, vocab: int,
                   delta: float | None, lam: float | None,
                   receivers: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """p (B, M, K) at M nodes; q_on_support (B, M, K) the draft distribution at p's support tokens (K distinct
    tokens per node); neighbours (V, k) each code's nearest codes, nearest first, self excluded. Exactly one of
    delta (LANTERN) / lam (LANTERN++). receivers (B, M, R): the only support slots that can receive (a
    deterministic draft's candidates; None: every slot); a slot listed twice receives once.
    Returns p_hat probs on p's support (B, M, K) and the moved mass TV(p_hat, p) (B, M)."""
    b, m, k_sup = p.probs.shape
    ps, qs, ids = (x.reshape(b * m, k_sup) for x in (p.probs, q_on_support, p.ids))
    slots = None if receivers is None else receivers.reshape(b * m, -1)
    n_recv = k_sup if slots is None else slots.shape[1]
    p_hat, moved = torch.empty_like(ps), ps.new_empty(b * m)
    rows, cols = _block_shape(n_recv, neighbours.shape[1], vocab)
    for start in range(0, b * m, rows):
        part = slice(start, start + rows)
        p_hat[part], moved[part] = _bounded_rows(ps[part], qs[part], ids[part], None if slots is None else slots[part],
                                                 neighbours, vocab, delta, lam, cols)
    return p_hat.view(b, m, k_sup), moved.view(b, m)


def _block_shape(n_recv: int, k: int, vocab: int) -> tuple[int, int]:
    """(rows per block, neighbours per block) keeping a block's temporaries within WORKSPACE_BYTES."""
    cols = max(1, min(k, WORKSPACE_BYTES // (_BYTES_PER_PAIR * max(n_recv, 1))))
    rows = max(1, WORKSPACE_BYTES // (_BYTES_PER_PAIR * max(n_recv, 1) * cols + _BYTES_PER_CODE * vocab))
    return rows, cols


def _bounded_rows(ps, qs, ids, slots, neighbours, vocab, delta, lam, cols):
    """bounded_target on r rows: ps, qs, ids (r, K), slots (r, R) or None."""
    excess = (ps - qs).clamp_min(0.0)  # sources
    want = (qs - ps).clamp_min(0.0) * (ps > 0)  # receivers, never a token AR cannot emit
    if lam is not None:
        want = torch.minimum(want, (lam - 1.0) * ps)
    if slots is not None:  # a slot listed twice receives once (want already holds its whole due)
        first = torch.ones_like(slots, dtype=torch.bool)
        first[:, 1:] = ~(slots[:, 1:, None] == slots[:, None, :-1]).tril().any(-1)
        recv_ids, want = ids.gather(1, slots), torch.where(first, want.gather(1, slots), 0.0)
    else:
        recv_ids = ids
    lists = _NeighbourLists(recv_ids, neighbours, vocab, cols)
    total = lists.sum_at(_per_code(ids, excess, vocab))  # what each receiver's neighbours could give
    take = torch.minimum(want, total)
    ratio = torch.where(total > 0, take / total.clamp_min(1e-30), 0.0)  # receiver y <- z: ratio(y) * excess(z)
    asked = lists.spread(ratio).gather(1, ids)  # (r, K): each source's excess is asked asked(z) times over
    give = torch.where(asked > 1, excess / asked.clamp_min(1e-30), excess)  # no source gives more than its excess
    inflow = ratio * lists.sum_at(_per_code(ids, give, vocab))
    outflow = give * asked
    moved = outflow.sum(-1)
    if delta is not None:
        cut = torch.where(moved > delta, delta / moved.clamp_min(1e-30), 1.0)[:, None]
        inflow, outflow, moved = inflow * cut, outflow * cut, torch.minimum(moved, torch.full_like(moved, delta))
    if slots is not None:
        inflow = torch.zeros_like(ps).scatter_add_(1, slots, inflow)
    return (ps + inflow - outflow).clamp_min(0.0), moved


def _per_code(ids: torch.Tensor, values: torch.Tensor, vocab: int) -> torch.Tensor:
    """(r, K) values at distinct support ids -> (r, V), 0 off the support."""
    return torch.zeros(ids.shape[0], vocab, dtype=values.dtype, device=values.device).scatter_(1, ids, values)


class _NeighbourLists:
    """The receivers' neighbour lists, read `cols` neighbours at a time: sum_at reads a per-code vector at every
    receiver's neighbours, spread is its transpose (each receiver's value added to each of its neighbours). Lists
    read in one block are kept for every pass (the block fits WORKSPACE_BYTES); more blocks are read anew."""

    def __init__(self, recv_ids: torch.Tensor, neighbours: torch.Tensor, vocab: int, cols: int):
        self.recv_ids, self.neighbours, self.vocab, self.cols = recv_ids, neighbours, vocab, cols
        self._whole = self._read(0) if cols >= neighbours.shape[1] else None

    def _read(self, start: int) -> torch.Tensor:
        block = self.neighbours[:, start:start + self.cols]
        rows = torch.index_select(block, 0, self.recv_ids.flatten())  # (r * R, c): whole rows, copied at once
        return rows.long().view(self.recv_ids.shape[0], -1)  # (r, R * c)

    def _blocks(self):
        if self._whole is not None:
            yield self._whole
            return
        for start in range(0, self.neighbours.shape[1], self.cols):
            yield self._read(start)

    def sum_at(self, per_code: torch.Tensor) -> torch.Tensor:
        """(r, V) -> (r, R): the sum over each receiver's neighbours."""
        out = per_code.new_zeros(self.recv_ids.shape)
        for nb in self._blocks():
            out = out + per_code.gather(1, nb).view(*self.recv_ids.shape, -1).sum(-1)
        return out

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """(r, R) -> (r, V): each code's sum over the receivers it neighbours."""
        out = values.new_zeros(values.shape[0], self.vocab)
        for nb in self._blocks():
            c = nb.shape[1] // values.shape[1]
            out.scatter_add_(1, nb, values[..., None].expand(-1, -1, c).flatten(1))
        return out


def paper_boost(residual: Support, original_px: torch.Tensor, x: torch.Tensor, neighbours: torch.Tensor,
                delta: float | None, lam: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The papers' per-candidate rule at candidates x (B, M) against the residual (B, M, K) on its support.
    Returns (p~(x), boost C_m*(x)), each (B, M); no boost where the original p(x) is 0."""
    found = residual.lookup()
    px = found.prob(x[..., None])[..., 0]
    cum = found.prob(neighbours[x].long()).double().cumsum(-1)  # (B, M, k) C_1..C_k, non-decreasing
    bound = torch.full_like(px, delta).double() if delta is not None else (lam - 1.0) * px.double()
    m = (cum <= bound[..., None]).sum(-1)  # qualifying m form a prefix: m* is their count
    boost = torch.where(m > 0, cum.gather(-1, (m - 1).clamp_min(0)[..., None])[..., 0], 0.0).float()
    boost = torch.where(original_px > 0, boost, 0.0)
    return px + boost, boost
