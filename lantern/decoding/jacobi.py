"""Speculative Jacobi decoding's pieces (SJD, and MC-SJD's coupled noise), for the engine's Jacobi proposer
(lantern.engine.proposers): no drafter; each image keeps a window of L drafts after its root, verified as one
causal chain [root; d_1 .. d_L] whose node i is written at its own position's slot (so a step never commits),
accepted as a chain (lantern.decoding.acceptance), then slid past the new root and redrawn from this step's p.
Positions never predicted yet take the spatial prior (`initial="above"`: the decided token one grid row up, as a
point-mass q) or the last p the step has (`initial="last"`). The maths, and why the coupling stays lossless:
docs/algorithms.md section 6.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from lantern.decoding.sampling import Draws, Support, draw, gumbel


def redraw(q: Support, noise: Optional[torch.Tensor], greedy: bool, generator: Draws,
           n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L, K) distributions -> each position's first n drafts (B, L, n) and whether each is one (B, L, n): the
    top n of q (greedy), or n draws without replacement in draw order, the top n of log q + G with G (B, L, K)
    each position's fixed noise at q's support tokens (coupled) or fresh noise. The first is the argmax (greedy)
    or one exact draw from q; a draft past q's support (probability 0) is not one."""
    if n == 1 and (greedy or noise is None):
        token = draw(q, greedy, generator)[..., None]
        return token, torch.ones_like(token, dtype=torch.bool)
    keys = q.probs.log()
    if not greedy:  # Gumbel top-n on the support: sequential draws without replacement, exact
        keys = keys + (noise if noise is not None else gumbel(keys.shape, generator, keys.device))
    top = torch.topk(keys, min(n, keys.shape[-1]), dim=-1)
    tokens, valid = q.ids.gather(2, top.indices), torch.isfinite(top.values)
    if tokens.shape[-1] < n:  # a support narrower than the branching: the missing candidates are none
        pad = n - tokens.shape[-1]
        tokens = torch.cat([tokens, tokens[..., :1].expand(*tokens.shape[:-1], pad)], -1)
        valid = torch.cat([valid, torch.zeros_like(valid[..., :1]).expand(*valid.shape[:-1], pad)], -1)
    return tokens, valid


class CoupledNoise:
    """MC-SJD's noise G(image, position, token), one Gumbel each, fixed while the position is in the window.
    Only the tokens of a position's support are ever read, so G(., pos, token) is drawn the first time the
    token is in the support at that position and kept from then on; drawn later or up front, it is the same
    independent Gumbel. Kept in a ring of L slots (slot = position mod L: a window's L positions are
    consecutive) with the position each value was drawn for, so a step touches (B, L, K) values, not (B, L, V)."""

    def __init__(self, b: int, window: int, vocab: int, device):
        self.window, self.vocab = window, vocab
        self.values = torch.zeros(b, window * vocab, device=device)
        self.drawn_for = torch.full((b, window * vocab), -1, dtype=torch.long, device=device)

    def at(self, positions: torch.Tensor, ids: torch.Tensor, generator: Draws,
           rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """positions (B, L) of the window, ids (B, L, K) their supports (K distinct tokens each) -> G (B, L, K).
        rows (B,) bool: only these images keep what was drawn (None: all)."""
        index = ((positions % self.window)[..., None] * self.vocab + ids).flatten(1)  # (B, L*K)
        pos = positions[..., None].expand_as(ids).flatten(1)
        old_values, old_for = self.values.gather(1, index), self.drawn_for.gather(1, index)
        g = torch.where(old_for == pos, old_values, gumbel(index.shape, generator, index.device))
        if rows is not None:
            keep = rows[:, None]
            self.values.scatter_(1, index, torch.where(keep, g, old_values))
            self.drawn_for.scatter_(1, index, torch.where(keep, pos, old_for))
        else:
            self.values.scatter_(1, index, g)
            self.drawn_for.scatter_(1, index, pos)
        return g.view(ids.shape)

    def forget(self, rows: torch.Tensor) -> None:
        """rows (B,) bool: these images start afresh (a new request in the slot): nothing drawn yet."""
        self.drawn_for.masked_fill_(rows[:, None], -1)


def spatial_prior(q: Support, fresh: torch.Tensor, decided: torch.Tensor, emitted: torch.Tensor, grid: int,
                  vocab: int) -> Support:
    """q (B, L, K) of the window, whose slot w holds image token emitted + w -> the same, but where `fresh`
    (B, L) (never predicted yet) and the token one grid row up is decided (among decided[:, :emitted]), the
    point mass on that token."""
    _, window, k = q.ids.shape
    above = emitted[:, None] + torch.arange(window, device=q.ids.device)[None] - grid  # (B, L)
    use = (fresh & (above >= 0) & (above < emitted[:, None]))[..., None]
    token = decided.gather(1, above.clamp(min=0))  # (B, L)
    # a support holds K distinct tokens in descending order: the token, then K - 1 others at probability 0
    rank = torch.arange(k, device=q.ids.device)
    ids = (token[..., None] + rank) % vocab
    point = (rank == 0).to(q.probs.dtype)  # (K,) all the mass on the first
    return Support(torch.where(use, point, q.probs), torch.where(use, ids, q.ids))


@dataclass(frozen=True)
class WindowTree:
    """The static tree a Jacobi step verifies. A path is a tuple of ranks from the root, as in
    lantern.decoding.trees. The window's chain (0,), (0, 0), ... down to depth L; with branching K > 1, every path of
    candidate ranks below K down to depth `branch_depth` (candidate r at depth d: the r-th draw without replacement
    from the window's q there), each leaf continued by `tail` nodes of the window's own drafts (the stale tail,
    rank 0), at most down to depth L. With guesses G > 0, each chain node above depth `guess_depth` also has G
    guess children (ranks K .. K + G - 1): tokens a bonus drawn there would likely be, verified but never
    accepted, so that when the bonus is one the next step has p after it; each continued by `guess_tail` stale
    drafts. Node i <= L is the chain's node at depth i (its own position), the others follow by depth. Built
    once, shared by every image."""

    window: int
    branching: int = 1
    branch_depth: int = 1
    tail: int = 0
    guesses: int = 0
    guess_depth: int = 1
    guess_tail: int = 0
    # the buffers below, filled by __post_init__ (static)
    depth: torch.Tensor = field(init=False, repr=False, compare=False)  # (N,) node depth (the root: 0)
    ancestors: torch.Tensor = field(init=False, repr=False, compare=False)  # (N, N) j is i or an ancestor of i
    parents: torch.Tensor = field(init=False, repr=False, compare=False)  # (M,) nodes with candidate children
    children: torch.Tensor = field(init=False, repr=False, compare=False)  # (M, K) them in rank order (-1: none)
    rank: torch.Tensor = field(init=False, repr=False, compare=False)  # (N,) a node's rank among its siblings
    candidate: torch.Tensor = field(init=False, repr=False, compare=False)  # (N,) bool: may be accepted
    draft: torch.Tensor = field(init=False, repr=False, compare=False)  # (N,) its column in [candidates; guesses]
    guess_nodes: torch.Tensor = field(init=False, repr=False, compare=False)  # (N, G) a node's guesses (-1: none)
    successor: torch.Tensor = field(init=False, repr=False, compare=False)  # (N, 2L + 2) the node at depth e ahead

    def __post_init__(self):
        window, k, g = self.window, self.branching, self.guesses
        chain = [(0,) * d for d in range(window + 1)]
        others = set()
        if k > 1:
            level = [()]
            for _ in range(min(self.branch_depth, window)):
                level = [p + (r,) for p in level for r in range(k)]
                others.update(level)
            for leaf in level:
                others.update(leaf + (0,) * t for t in range(1, min(self.tail, window - len(leaf)) + 1))
        for d in range(1, min(self.guess_depth, window) + 1):
            for r in range(k, k + g):
                guess = (0,) * (d - 1) + (r,)
                others.update(guess + (0,) * t for t in range(min(self.guess_tail, window - d) + 1))
        paths = chain + sorted(others - set(chain), key=lambda p: (len(p), p))
        node = {p: i for i, p in enumerate(paths)}
        n = len(paths)
        candidate = [all(r < k for r in p) for p in paths]
        kids = [[] for _ in range(n)]
        guess_nodes = torch.full((n, max(g, 1)), -1, dtype=torch.long)
        for p in paths[1:]:
            parent = node[p[:-1]]
            if candidate[node[p]]:
                kids[parent].append((p[-1], node[p]))
            elif p[-1] >= k:
                guess_nodes[parent, p[-1] - k] = node[p]
        parents = [i for i in range(n) if kids[i]]
        table = torch.full((len(parents), k), -1, dtype=torch.long)
        for row, i in enumerate(parents):
            for r, child in kids[i]:
                table[row, r] = child
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(paths):
            for d in range(len(p) + 1):
                ancestors[i, node[p[:d]]] = True
        # the node at depth e ahead of each node: its rank-0 descendants while they last, then the window's chain;
        # -1 past the window (a position no node predicts yet)
        successor = torch.full((n, 2 * window + 2), -1, dtype=torch.long)
        for i, p in enumerate(paths):
            for e in range(len(p) + 1, 2 * window + 2):
                successor[i, e] = node.get(p + (0,) * (e - len(p)), e if e <= window else -1)
        # candidate r at depth d: column (d - 1) * K + r of the candidates; guess j: column L * K + (d - 1) * G + j
        draft = [0] + [(len(p) - 1) * k + p[-1] if p[-1] < k else window * k + (len(p) - 1) * g + p[-1] - k
                       for p in paths[1:]]
        for name, value in dict(depth=torch.tensor([len(p) for p in paths]), ancestors=ancestors,
                                parents=torch.tensor(parents), children=table,
                                rank=torch.tensor([p[-1] if p else 0 for p in paths]),
                                candidate=torch.tensor(candidate), draft=torch.tensor(draft),
                                guess_nodes=guess_nodes[:, :g], successor=successor).items():
            object.__setattr__(self, name, value)

    @property
    def size(self) -> int:
        return self.depth.shape[0]

    @property
    def is_chain(self) -> bool:
        return self.size == self.window + 1
