"""Relaxed acceptance over VQ latent neighbours: lantern's bounded relaxed target, and the papers' boost.

Bounded (lantern's default; docs/algorithms.md): before any draw, each node gets a fixed target p_hat that
moves probability from sources z (p(z) > q(z)) to receivers y (q(y) > p(y) > 0) among y's k nearest
codebook neighbours: at most delta in all (LANTERN form) or at most (lam - 1) * p(y) into each y (LANTERN++
form). Exact recursive rejection against p_hat outputs exactly p_hat, so each token's distribution is within
TV(p_hat, p) = the moved mass of the target, recorded per token. For deterministic top-k drafts "q" is the
fixed candidate set (q = 1 on candidates, 0 elsewhere), and only the candidates can receive.

Paper (LANTERN / LANTERN++ as their code runs it, kept for comparison): per candidate x, p~(x) = r(x) + C_m*(x)
with r the residual x is tested against, C_m the residual mass of x's m nearest neighbours, m* the largest m <= k
with C_m <= delta (or (lam-1) r(x)); a rejection then also clears x's k + 1 nearest codes (acceptance.py says
where). Its output distortion is not bounded by delta (docs/algorithms.md measures it); it boosts p(x) = 0 too.

Memory and time: nothing here is quadratic in the support. A node's flows are three sums over neighbour lists
(what each receiver's sources hold, how often each source is asked, what each receiver gets), walked one of two
ways, chosen from the shapes alone (`walks_the_codebook`):
- over the receivers, when a node has few (a deterministic draft's candidates, a narrow support): each
  receiver's k-neighbour list is read against one dense per-code vector per row, in blocks of rows x receivers x
  neighbours of at most WORKSPACE_BYTES; O(rows * R * k) time;
- over the codebook, when the receivers are a sizeable share of it (R * CODEBOOK_SHARE >= V: sampled drafts over a
  wide support) and its lists fit the workspace: every code's sum at once for all rows, the per-code values laid
  out (V, rows) and summed through the proximity table's own lists and their transpose (`NeighbourLinks`, built
  once per rule) by embedding_bag, one index shared by every row; O(rows * V * k) additions, far cheaper per pair
  than the receiver walk's per-row gathers (16 images x 16 positions over 1024 codes, k = 64: ~10x).
Either way a step's extra memory is O(rows * (K + V)), its temporaries and the lists each within WORKSPACE_BYTES,
and every shape is fixed by the configuration, so nothing waits on the device.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lantern.decoding.sampling import Support, SupportLookup

WORKSPACE_BYTES = 64 * 2**20  # the most one block of neighbour-list temporaries may hold
CODEBOOK_SHARE = 16  # walk the codebook once a node's receivers times this reach its size (the walks tie near 16)
_BYTES_PER_PAIR = 16  # a (receiver, neighbour) pair in a receiver-walk block: its int64 id, its compact id, the value
_BYTES_PER_CODE = 12  # a row's dense per-code scratch: three float32 vectors over the vocabulary
_BYTES_PER_MATCH = 5  # a narrow support's pair compared with one support token: the flag and the value it selects
# NeighbourLinks' int32 lists and transpose (8 bytes a pair), and at most 12 more while one is built (the sort's
# int32 keys and int64 order) or one embedding_bag keeps its per-pair bookkeeping
_LINK_BYTES_PER_PAIR = 20


def walks_the_codebook(receivers: int, vocab: int, k: int) -> bool:
    """Whether a node with `receivers` receiving slots is walked over the codebook (else over its receivers): when
    they are a sizeable share of it and the lists fit the workspace (LlamaGen's k = 1000 of 16384 codes: 330 MB,
    so the receiver walk)."""
    return receivers * CODEBOOK_SHARE >= vocab and links_bytes(vocab, k) <= WORKSPACE_BYTES


def links_bytes(vocab: int, k: int) -> int:
    """The most a (vocab, k) table's NeighbourLinks hold at once, with a codebook walk's bookkeeping."""
    return _LINK_BYTES_PER_PAIR * vocab * k


class NeighbourLinks:
    """A proximity table's first k lists (V, k), nearest first, as the bounded target reads them: the table itself
    (the receiver walk gathers its rows), and, built on the codebook walk's first use, the lists as int32
    embedding_bag indices with their transpose: for each code z the codes whose lists hold z, in code order
    (`holders`, V * k), and where each code's run starts (`starts`, V). Kept per rule and device
    (Acceptance.links), so the transpose's sort runs once, in the first step (which runs eagerly)."""

    def __init__(self, table: torch.Tensor):
        self.table = table  # (V, k) any integer type
        self._codebook = None

    def codebook(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lists (V, k), holders (V * k,), starts (V,)), int32."""
        if self._codebook is None:
            v, k = self.table.shape
            lists = self.table.to(torch.int32)
            listed, order = lists.flatten().sort(stable=True)  # every (code, neighbour) pair, by neighbour
            holders = order.div_(k, rounding_mode="floor").to(torch.int32)
            codes = torch.arange(v, dtype=torch.int32, device=lists.device)
            self._codebook = lists, holders, torch.searchsorted(listed, codes, out_int32=True)
        return self._codebook


def bounded_target(p: Support, q_on_support: torch.Tensor, links: NeighbourLinks, vocab: int,
                   delta: float | None, lam: float | None,
                   receivers: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """p (B, M, K) at M nodes; q_on_support (B, M, K) the draft distribution at p's support tokens (K distinct
    tokens per node); links: each code's k nearest codes, nearest first, self excluded. Exactly one of
    delta (LANTERN) / lam (LANTERN++). receivers (B, M, R): the only support slots that can receive (a
    deterministic draft's candidates; None: every slot); a slot listed twice receives once.
    Returns p_hat probs on p's support (B, M, K) and the moved mass TV(p_hat, p) (B, M)."""
    b, m, k_sup = p.probs.shape
    ps, qs, ids = (x.reshape(b * m, k_sup) for x in (p.probs, q_on_support, p.ids))
    slots = None if receivers is None else receivers.reshape(b * m, -1)
    n_recv = k_sup if slots is None else slots.shape[1]
    if walks_the_codebook(n_recv, vocab, links.table.shape[1]):
        rows = max(1, WORKSPACE_BYTES // (_BYTES_PER_CODE * vocab))
        walk = partial(_CodebookWalk, links=links, vocab=vocab)
    else:
        rows, cols = _block_shape(n_recv, links.table.shape[1], vocab, k_sup)
        walk = partial(_ReceiverWalk, table=links.table, vocab=vocab, cols=cols)
    blocks = [_bounded_rows(ps[part], qs[part], ids[part], None if slots is None else slots[part], walk, delta, lam)
              for part in (slice(start, start + rows) for start in range(0, b * m, rows))]
    p_hat, moved = blocks[0] if len(blocks) == 1 else (torch.cat(x) for x in zip(*blocks))
    return p_hat.view(b, m, k_sup), moved.view(b, m)


def _block_shape(n_recv: int, k: int, vocab: int, support: int) -> tuple[int, int]:
    """The receiver walk's (rows per block, neighbours per block), its temporaries within WORKSPACE_BYTES: a
    narrow support compares each pair with its K tokens (a flag and a value per token) instead of keeping a
    per-code vector a row."""
    narrow = support <= SupportLookup.NARROW
    pair = _BYTES_PER_PAIR + (_BYTES_PER_MATCH * support if narrow else 0)
    cols = max(1, min(k, WORKSPACE_BYTES // (pair * max(n_recv, 1))))
    rows = max(1, WORKSPACE_BYTES // (pair * max(n_recv, 1) * cols + (0 if narrow else _BYTES_PER_CODE * vocab)))
    return rows, cols


def _bounded_rows(ps, qs, ids, slots, walk, delta, lam):
    """bounded_target on r rows: ps, qs, ids (r, K), slots (r, R) or None; walk(ids, receivers' ids) reads the
    neighbour lists."""
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
    lists = walk(ids, recv_ids)
    total = lists.sum_at(excess)  # what each receiver's neighbours could give
    take = torch.minimum(want, total)
    ratio = torch.where(total > 0, take / total.clamp_min(1e-30), 0.0)  # receiver y <- z: ratio(y) * excess(z)
    asked = lists.spread(ratio)  # (r, K): each source's excess is asked asked(z) times over
    give = torch.where(asked > 1, excess / asked.clamp_min(1e-30), excess)  # no source gives more than its excess
    inflow = ratio * lists.sum_at(give)
    outflow = give * asked
    moved = outflow.sum(-1)
    if delta is not None:
        cut = torch.where(moved > delta, delta / moved.clamp_min(1e-30), 1.0)[:, None]
        inflow, outflow, moved = inflow * cut, outflow * cut, torch.minimum(moved, torch.full_like(moved, delta))
    if slots is not None:
        inflow = torch.zeros_like(ps).scatter_add_(1, slots, inflow)
    return (ps + inflow - outflow).clamp_min(0.0), moved


class _ReceiverWalk:
    """The receivers' neighbour lists, read `cols` neighbours at a time: sum_at sums support values over each
    receiver's neighbours, spread is its transpose (each receiver's value added to each of its neighbours). Each
    listed code is found in the support by a dense (r, V) per-code vector, or, on a narrow support (K <=
    SupportLookup.NARROW), by comparing it with the K support tokens (no scatter: a compiled step fuses it with its
    neighbours). Lists read in one block are kept for every pass (the block fits WORKSPACE_BYTES); more blocks are
    read anew. ids (r, K) the support, recv_ids (r, R) the receivers' tokens."""

    def __init__(self, ids: torch.Tensor, recv_ids: torch.Tensor, table: torch.Tensor, vocab: int, cols: int):
        self.ids, self.recv_ids, self.table, self.vocab, self.cols = ids, recv_ids, table, vocab, cols
        self.narrow = ids.shape[-1] <= SupportLookup.NARROW
        self._whole = self._read(0) if cols >= table.shape[1] else None

    def _read(self, start: int) -> torch.Tensor:
        block = self.table[:, start:start + self.cols]
        rows = torch.index_select(block, 0, self.recv_ids.flatten())  # (r * R, c): whole rows, copied at once
        return rows.long().view(self.recv_ids.shape[0], -1)  # (r, R * c)

    def _blocks(self):
        if self._whole is not None:
            yield self._whole
            return
        for start in range(0, self.table.shape[1], self.cols):
            yield self._read(start)

    def _matches(self, nb: torch.Tensor) -> torch.Tensor:
        """(r, R * c) listed codes -> (r, R * c, K) bool: the support slot holding each (at most one)."""
        return nb[..., None] == self.ids[:, None, :]

    def sum_at(self, values: torch.Tensor) -> torch.Tensor:
        """(r, K) on the support -> (r, R): the sum over each receiver's neighbours (0 off the support)."""
        per_code = None if self.narrow else values.new_zeros(values.shape[0], self.vocab).scatter_(1, self.ids, values)
        out = values.new_zeros(self.recv_ids.shape)
        for nb in self._blocks():
            if self.narrow:  # each listed code's value: the one matching slot's, plus zeros (exact)
                listed = torch.where(self._matches(nb), values[:, None, :], 0.0).sum(-1)
            else:
                listed = per_code.gather(1, nb)
            out = out + listed.view(*self.recv_ids.shape, -1).sum(-1)
        return out

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """(r, R) -> (r, K): each support token's sum over the receivers it neighbours."""
        out = values.new_zeros(values.shape[0], self.ids.shape[1] if self.narrow else self.vocab)
        for nb in self._blocks():
            c = nb.shape[1] // values.shape[1]
            pairs = values[..., None].expand(-1, -1, c).flatten(1)  # (r, R * c) each receiver's value per neighbour
            if self.narrow:
                out = out + torch.where(self._matches(nb), pairs[..., None], 0.0).sum(1)
            else:
                out.scatter_add_(1, nb, pairs)
        return out if self.narrow else out.gather(1, self.ids)


class _CodebookWalk:
    """Every code's sum over its list at once for all r rows: the per-code values, scattered (r, V) and laid out
    (V, r) so that a code's r values sit side by side, summed through NeighbourLinks' lists (sum_at) or their
    transpose (spread) by embedding_bag, then read at the receivers or the support. ids (r, K) the support,
    recv_ids (r, R) the receivers' tokens."""

    def __init__(self, ids: torch.Tensor, recv_ids: torch.Tensor, links: NeighbourLinks, vocab: int):
        self.ids, self.recv_ids, self.vocab = ids, recv_ids, vocab
        self.lists, self.holders, self.starts = links.codebook()

    def _by_code(self, at: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(r, n) ids and values -> (V, r), summed where an id repeats in a row, 0 elsewhere."""
        per_code = values.new_zeros(values.shape[0], self.vocab).scatter_add_(1, at, values)
        return per_code.t().contiguous()

    def sum_at(self, values: torch.Tensor) -> torch.Tensor:
        """(r, K) on the support -> (r, R): the sum over each receiver's neighbours (0 off the support)."""
        sums = F.embedding_bag(self.lists, self._by_code(self.ids, values), mode="sum")  # (V, r)
        return sums.t().gather(1, self.recv_ids)

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """(r, R) -> (r, K): each support token's sum over the receivers it neighbours."""
        per_code = self._by_code(self.recv_ids, values)
        sums = F.embedding_bag(self.holders, per_code, self.starts, mode="sum")  # (V, r): over the codes holding each
        return sums.t().gather(1, self.ids)


class PaperTest(NamedTuple):
    """LANTERN's per-candidate test at candidates x (B, M): p~(x) = r(x) + C_m*(x), and what a rejection clears."""

    p_tilde: torch.Tensor  # (B, M) the boosted probability x is tested with
    boost: torch.Tensor  # (B, M) C_m*(x), 0 where no m qualifies
    cleared: torch.Tensor  # (B, M, K) bool: the support slots among x's k + 1 nearest codes, where some m qualified


def paper_test(residual: Support, x: torch.Tensor, neighbours: torch.Tensor, k: int,
               delta: float | None, lam: float | None) -> PaperTest:
    """LANTERN's rule (jadohu/LANTERN `evaluate_posterior`, `evaluate_posterior_v1`) at candidates x (B, M)
    against the residual r (B, M, K) on its support: C_m(x) = r(n_1(x)) + ... + r(n_m(x)), m* the largest m <= k
    with C_m(x) <= delta (or (lam - 1) r(x)). Every x is boosted, r(x) = 0 too (a token outside the target's
    top-k), as LANTERN does. neighbours (V, >= k): each code's nearest codes; a rejection clears x's first k + 1
    (as many as the table holds) where an m qualified. Sums in r's dtype (float32, as LANTERN)."""
    found = residual.lookup()
    px = found.prob(x[..., None])[..., 0]
    near = neighbours[x].long()  # (B, M, k + 1 or fewer)
    cum = found.prob(near[..., :k]).cumsum(-1)  # (B, M, k) C_1..C_k, non-decreasing
    bound = torch.full_like(px, delta) if delta is not None else (lam - 1.0) * px
    m = (cum <= bound[..., None]).sum(-1)  # qualifying m form a prefix: m* is their count
    boosted = m > 0
    boost = torch.where(boosted, cum.gather(-1, (m - 1).clamp_min(0)[..., None])[..., 0], 0.0)
    slot, on_support = found.position(near)
    flags = (on_support & boosted[..., None]).to(torch.int32)  # a code off the support adds 0 at slot 0
    cleared = torch.zeros(residual.probs.shape, dtype=torch.int32, device=px.device).scatter_add_(-1, slot, flags) > 0
    return PaperTest(px + boost, boost, cleared)
