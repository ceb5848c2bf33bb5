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

from lantern.decoding.sampling import Draws, Support, SupportLookup, draw, gumbel
from lantern.decoding.trees import CompiledTree, compile_tree


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
    """MC-SJD's noise G(image, position, token): one Gumbel each, a pure function of the image's seed, the position
    and the token (the engine's keyed draws, lantern.engine.draws), so it reads the same whenever and by whichever
    node it is read, for the image's whole life, and nothing is kept. Only the tokens of a position's support are
    ever read: (B, L, K) values a step, not (B, L, V)."""

    def at(self, positions: torch.Tensor, ids: torch.Tensor, draws) -> torch.Tensor:
        """positions (B, L), ids (B, L, K) their supports -> G (B, L, K). draws: the slots' streams (SlotStreams
        with `keyed_uniform`)."""
        u = draws.keyed_uniform(positions[..., None].expand_as(ids), ids)
        return -torch.log(-torch.log(u))


def nearest_candidate(bonus: torch.Tensor, candidates: torch.Tensor, valid: torch.Tensor,
                      proximity: torch.Tensor) -> torch.Tensor:
    """bonus (B,) the token drawn after every candidate at its position was rejected, candidates (B, C) those
    candidates in rank order, valid (B, C) -> (B,) the column of the candidate nearest the bonus in the codebook
    (earliest in the bonus's proximity list, (V, n) neighbours by distance), 0 (rank 0, the chain's draft) where no
    valid candidate is among the bonus's n neighbours."""
    listed = proximity[bonus].long()  # (B, n)
    at = listed[:, None, :] == candidates[..., None]  # (B, C, n)
    rank = torch.where(at.any(-1) & valid, at.int().argmax(-1), listed.shape[1])  # (B, C): n where not listed
    return torch.where(rank.amin(-1) < listed.shape[1], rank.argmin(-1), 0)


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


FAN_SHARE = 0.05  # the untruncated distribution's share of a fanned window's drafts (mixed in: fan_drafts)


def fan_drafts(q: Support, broad: Support, vocab: int) -> Support:
    """q (B, L, K) the window's distributions cut by top-k or top-p; broad (B, L, W) the same positions'
    distributions uncut, on their W most likely tokens (q's among them) -> what a fanned window draws from:
    (1 - FAN_SHARE) q + FAN_SHARE broad, on broad's support. A fan's candidates run past q's K tokens, where q
    has no mass and could never be accepted; here each has a little and is tested against it (recursive
    rejection against the distribution drawn from: exact for any)."""
    mixed = (1 - FAN_SHARE) * SupportLookup(q, vocab).prob(broad.ids) + FAN_SHARE * broad.probs
    return Support(mixed / mixed.sum(-1, keepdim=True), broad.ids)


def fan_width(tree: "WindowTree", sampling, vocab: int) -> int:
    """W: the tokens of a fanned window's draft distributions where the sampling cuts the support (top-k, top-p),
    the cut K and then the window's ranks, so that the fan's candidates can lie past the cut; 0 where no mixture is
    drawn (no fan, greedy, or the whole vocabulary)."""
    cut = sampling.support_size(vocab)
    if not tree.fan or sampling.greedy or (cut >= vocab and sampling.top_p >= 1.0):
        return 0
    return min(vocab, cut + tree.ranks)


def widened(q: Support, width: int, vocab: int) -> Support:
    """(..., K) -> (..., width >= K): the same distribution, its support followed by the smallest ids off it at
    probability 0, so that it takes a fanned window's static width."""
    free = torch.ones(*q.ids.shape[:-1], vocab, dtype=torch.bool, device=q.ids.device).scatter_(-1, q.ids, False)
    key = torch.where(free, -torch.arange(vocab, device=q.ids.device, dtype=torch.float), float("-inf"))
    others = torch.topk(key, width - q.ids.shape[-1], dim=-1).indices
    return Support(torch.cat([q.probs, torch.zeros_like(others, dtype=q.probs.dtype)], -1),
                   torch.cat([q.ids, others], -1))


@dataclass(frozen=True)
class WindowTree:
    """The static tree a Jacobi step verifies. A path is a tuple of candidate ranks from the root, as in
    lantern.decoding.trees: the window's chain (0,), (0, 0), ... down to depth L; with branching K > 1, every path
    of ranks below K down to depth `branch_depth` (candidate r at depth d: the r-th of the window's ranked drafts
    there), each leaf continued by `tail` nodes of the window's own drafts (the stale tail, rank 0), at most down to
    depth L; and a `fan` of leaves at depth 1, ranks K .. K + fan - 1. branching 1 without a fan is the plain window,
    whose node i is at depth i (its own position: nothing to commit). Compiled as any tree (trees.compile_tree).
    Built once, shared by every image."""

    window: int
    branching: int = 1
    branch_depth: int = 1
    tail: int = 0
    fan: int = 0
    # filled by __post_init__ (static)
    compiled: CompiledTree = field(init=False, repr=False, compare=False)
    draft: torch.Tensor = field(init=False, repr=False, compare=False)  # (N,) (depth - 1) * ranks + rank: its draft
    successor: torch.Tensor = field(init=False, repr=False, compare=False)  # (N, 2L + 2) the node at depth e ahead

    def __post_init__(self):
        window, k = self.window, self.branching
        paths = {(0,) * d for d in range(1, window + 1)}
        if k > 1:
            level = [()]
            for _ in range(min(self.branch_depth, window)):
                level = [p + (r,) for p in level for r in range(k)]
                paths.update(level)
            for leaf in level:
                paths.update(leaf + (0,) * t for t in range(1, min(self.tail, window - len(leaf)) + 1))
        paths.update((r,) for r in range(k, k + self.fan))  # the fan: leaves after the first depth's candidates
        compiled = compile_tree(sorted(paths))
        nodes = ((),) + compiled.paths  # node i's path
        node = {p: i for i, p in enumerate(nodes)}
        # the node at depth e ahead of each node: its rank-0 descendants while they last, then the window's chain;
        # -1 past the window (a position no node predicts yet)
        successor = torch.full((len(nodes), 2 * window + 2), -1, dtype=torch.long)
        for i, p in enumerate(nodes):
            for e in range(len(p), 2 * window + 2):  # at its own depth, the node itself
                successor[i, e] = node.get(p + (0,) * (e - len(p)), node.get((0,) * e, -1))
        object.__setattr__(self, "compiled", compiled)
        object.__setattr__(self, "draft", torch.tensor([0] + [(len(p) - 1) * self.ranks + p[-1] for p in nodes[1:]]))
        object.__setattr__(self, "successor", successor)

    @property
    def ranks(self) -> int:
        """The ranked drafts each window slot offers: the branching candidates, then the fan's."""
        return self.branching + self.fan

    @property
    def size(self) -> int:
        return self.compiled.size

    @property
    def is_chain(self) -> bool:
        return self.compiled.is_chain
