"""Speculative Jacobi decoding (SJD) and its coupled form (MC-SJD) over any backend Runner, B images at once.

No drafter. Each image keeps a window of L drafts after its root (the last accepted token, not yet in the
cache); per step, for all B images:
  verify [root; d_1 .. d_L] as one causal chain (width L + 1; node i at position and slot root + i)
  -> the target's p after every node -> acceptance (lantern.decoding.acceptance, on a chain: each node has one
  child) tests d_1, d_2, ... against q_j, the distribution d_j was drawn from, with the exact rule (or the
  bounded relaxation: a fixed p_hat per position) -> the first rejected position gets a token from the residual
  normalise(max(p - q, 0)) (or from p after the last node when all L are accepted) -> the window slides past
  the new root and every draft is redrawn from this step's p at its position.
Node i's cache entry is written at its own position's slot, so the accepted prefix of the chain is already in
place: a step never commits. The step itself is the engine's (lantern.engine.step); its Jacobi proposer
(lantern.engine.proposers) keeps the window with the pieces below.

Initial drafts: a position never predicted yet (the window at the start, then the positions entering at its
far end) gets, with `initial="above"` (the default), the token one row up in the image's token grid when that
token is decided already (always, for a window no wider than the grid): q is the point mass on it. Otherwise,
and with `initial="last"`, its draft is drawn from the last distribution the step has: p after the last node
(at the start: the prefill's p). Either q is a function of earlier positions only, and the test is against
exactly that q. Images are mostly flat regions, so the token above is often right: on the embedded model the
prior raises MC-SJD's step compression by about a tenth at L = 8 and 16.

Coupling "gumbel" (MC-SJD): each (image, position) has Gumbel noise G over the vocabulary, fixed until the
position is decided (drawn token by token, as tokens enter the position's support: `CoupledNoise`); its draft
is argmax(log q + G), so an unchanged q redraws the same token. Still lossless: the model is causal and every
test at a position i < j reads only drafts, uniforms and p at positions <= i, so nothing a test at j
conditions on depends on G_j; given all of it, G_j is a fresh Gumbel and d_j ~ q_j exactly. The test's
uniforms and the residual draw use fresh noise.
Coupling "none" (SJD) draws every draft afresh each step.
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
    ids = (token[..., None] + torch.arange(k, device=q.ids.device)) % vocab
    point = torch.zeros_like(q.probs)
    point[..., 0] = 1.0
    return Support(torch.where(use, point, q.probs), torch.where(use, ids, q.ids))
