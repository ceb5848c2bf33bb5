"""Speculative Jacobi decoding's pieces (SJD, and MC-SJD's coupled noise), for the engine's Jacobi proposer
(lantern.engine.proposers): no drafter; each image keeps a window of L drafts after its root, verified as one
causal chain [root; d_1 .. d_L] whose node i is written at its own position's slot (so a step never commits),
accepted as a chain (lantern.decoding.acceptance), then slid past the new root and redrawn from this step's p.
Positions never predicted yet take the spatial prior (`initial="above"`: the decided token one grid row up, as a
point-mass q) or the last p the step has (`initial="last"`). The maths, and why the coupling stays lossless:
docs/algorithms.md section 6.
"""
from __future__ import annotations

from typing import Optional

import torch

from lantern.decoding.sampling import Draws, Support, draw, gumbel


def redraw(q: Support, noise: Optional[torch.Tensor], greedy: bool, generator: Draws) -> torch.Tensor:
    """(B, L, K) distributions -> (B, L) drafts: the argmax (greedy), argmax(log q + G) with G (B, L, K) each
    position's fixed noise at q's support tokens (coupled), or a fresh draw."""
    if greedy or noise is None:
        return draw(q, greedy, generator)
    pick = (q.probs.log() + noise).argmax(-1)  # Gumbel-max on the support: exact
    return q.ids.gather(2, pick[..., None])[..., 0]


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
