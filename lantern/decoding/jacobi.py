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
place: a step never commits. Finished images run as padding, as in lantern.decoding.loop.

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

import time
from typing import Optional

import torch

from lantern.backends.base import Runner
from lantern.decoding.acceptance import Acceptance, accept_chain
from lantern.decoding.config import DecodeConfig
from lantern.decoding.drafting import on_rows, window_mask
from lantern.decoding.loop import prefill
from lantern.decoding.sampling import Support, draw, gumbel, target_support
from lantern.decoding.stats import GenerationStats, StepRecords


def redraw(q: Support, noise: Optional[torch.Tensor], greedy: bool, generator: torch.Generator) -> torch.Tensor:
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

    def at(self, positions: torch.Tensor, ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """positions (B, L) of the window, ids (B, L, K) their supports (K distinct tokens each) -> G (B, L, K)."""
        index = ((positions % self.window)[..., None] * self.vocab + ids).flatten(1)  # (B, L*K)
        pos = positions[..., None].expand_as(ids).flatten(1)
        kept = self.drawn_for.gather(1, index) == pos
        g = torch.where(kept, self.values.gather(1, index), gumbel(index.shape, generator, index.device))
        self.values.scatter_(1, index, g)
        self.drawn_for.scatter_(1, index, pos)
        return g.view(ids.shape)


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


@torch.inference_mode()
def decode_jacobi(runner: Runner, cond_rows: torch.Tensor, dcfg: DecodeConfig, active: torch.Tensor, block: int,
                  generator: torch.Generator, rule: Acceptance) -> tuple[torch.Tensor, GenerationStats]:
    """B images, no drafter: one verify of every image's window per step; rule: `acceptance_rule(dcfg, ...)`.
    Returns tokens (B, block) and the stats of the active images (padding images of a short chunk start
    finished)."""
    sc, spec, dev = dcfg.sampling, runner.spec, runner.device
    window, rows = dcfg.strategy.window, sc.rows_per_image
    vocab = runner.model_config.vocab_size
    b = active.shape[0]
    nodes = torch.arange(window + 1, device=dev)
    causal = torch.ones(window + 1, window + 1, dtype=torch.bool, device=dev).tril()[None]  # (1, N, N)
    rank = torch.zeros(b, window + 1, dtype=torch.long, device=dev)  # every node is its parent's only child
    slots = torch.arange(spec.max_len, device=dev)
    t0 = time.perf_counter()
    with runner.phase("prefill"):
        logits, _ = prefill(runner, cond_rows)
        first = target_support(logits, sc)  # (B, K)
        root_tok = draw(first, sc.greedy, generator)  # (B,)
    coupled = dcfg.coupling == "gumbel" and not sc.greedy
    noise = CoupledNoise(b, window, vocab, dev) if coupled else None
    above = dcfg.initial == "above"
    grid = runner.model_config.grid_size
    out = torch.zeros(b, block + window + 2, dtype=torch.long, device=dev)  # the last column absorbs padding
    out[:, 0] = root_tok
    emitted = torch.where(active.to(dev), 1, block)  # (B,) tokens so far; padding images start finished
    q = Support(*(x[:, None].expand(-1, window, -1) for x in first))  # (B, L, K) never predicted: the last p
    if above:
        q = spatial_prior(q, torch.ones(b, window, dtype=torch.bool, device=dev), out, emitted, grid, vocab)
    root = torch.full((b,), spec.prefix_len, dtype=torch.long, device=dev)  # the root's position

    def window_drafts(q: Support) -> torch.Tensor:
        """(B, L, K) -> (B, L) drafts at positions root + 1 .. root + L (root as it is at the call)."""
        g = noise.at(root[:, None] + nodes[1:], q.ids, generator) if noise is not None else None
        return redraw(q, g, sc.greedy, generator)
    drafts = window_drafts(q)
    records = StepRecords()
    while True:
        running = emitted < block
        if not bool(running.any()):  # the one host sync of a step
            break
        # at most block - emitted - 1 drafts fit in the image; finished images accept none
        limit = torch.where(running, block - emitted - 1, -1)
        tokens = torch.cat([root_tok[:, None], drafts], 1)  # (B, L+1)
        positions = root[:, None] + nodes  # slot = position
        mask = window_mask(causal, root, slots[None] < root[:, None])  # committed cache + causal chain
        with runner.phase("verify"):
            o = runner.verify(on_rows(tokens, rows), on_rows(positions, rows), on_rows(positions, rows),
                              on_rows(mask, rows))
            p_nodes = target_support(o.logits, sc)  # (B, L+1, K): p after every node
        with runner.phase("accept"):
            acc = accept_chain(p_nodes, tokens, nodes[None] <= limit[:, None], None if sc.greedy else q, rule,
                               sc.greedy, generator, vocab)
        m = torch.where(running, acc.accepted, -1)  # finished images: nothing to emit
        new_tokens = torch.where(nodes[None] < m[:, None], torch.cat([drafts, acc.bonus[:, None]], 1),
                                 acc.bonus[:, None])  # (B, L+1): the accepted drafts, then the bonus
        col = torch.where(nodes[None] <= m[:, None], emitted[:, None] + nodes, out.shape[1] - 1)
        out.scatter_(1, col, new_tokens)
        records.add(running, acc, rank)
        advance = torch.where(running, m + 1, 0)
        root_tok = torch.where(running, acc.bonus, root_tok)
        root, emitted = root + advance, emitted + advance
        # window slot w now holds position root + 1 + w: p after node advance + w predicts it (if that node exists)
        predicted_by = advance[:, None] + nodes[:-1]  # (B, L)
        q = p_nodes.index(predicted_by.clamp(max=window))
        if above:
            q = spatial_prior(q, predicted_by > window, out, emitted, grid, vocab)
        drafts = window_drafts(q)
    stats = records.stats(active.cpu(), block, time.perf_counter() - t0)
    return out[:, :block].cpu(), stats
