"""What a step verifies: AR proposes nothing, a drafter proposes a tree (static or EAGLE-2 dynamic), Jacobi
proposes its window. One small protocol; the step (lantern.engine.step) verifies, accepts, commits and emits
for all of them.

A proposer keeps its own per-slot state, (B, ...) tensors like the engine's, and answers:
  reset(slots, fresh, first, features, prefix)
                                        new requests took the `fresh` (B,) slots: start their state from the
                                        prefill's distribution `first` (B, K) and features (R*B, P, D) at
                                        every prefix position (prefix: what a drafter that reads the prefix
                                        pairs with them, lantern.decoding.drafting.PrefixPairs)
  propose(slots) -> DraftedTree         every slot's candidates: node 0 is its root (the last accepted token)
  distributions(logits)                 the verify logits as the acceptance reads them (`.index(nodes)`)
  accept(p_nodes, tree) -> StepAcceptance
  advance(slots, step: Stepped)         after the step moved every running slot on by `step.advance` tokens
                                        (its last accepted pairs are step.new_tokens[:, :m+1])
Only the reset rows change in `reset`; rows that are not running carry garbage that no running row reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lantern.decoding.acceptance import Acceptance, DraftedTree, StepAcceptance, accept
from lantern.decoding.config import DecodeConfig
from lantern.decoding.drafting import DraftRunner, PrefixPairs, draft_dynamic, draft_static, on_rows
from lantern.decoding.jacobi import (CoupledNoise, fan_drafts, fan_width, nearest_candidate, redraw, spatial_prior,
                                     widened)
from lantern.decoding.sampling import GuidedLogits, Support, combine_cfg, draw, target_support
from lantern.decoding.strategy import StaticTree


@dataclass(frozen=True)
class Stepped:
    """What one step decided, for a proposer to carry its state on (`Proposer.advance`)."""

    tree: DraftedTree  # the proposal that was verified
    acc: StepAcceptance  # what acceptance made of it: the accepted path and the bonus token
    out: object  # the verify's StepOutput over the tree's nodes: logits (R*B, N, V), features (R*B, N, D)
    p_nodes: object  # the target's distributions at the nodes, as `distributions` returned them
    running: torch.Tensor  # (B,) bool: the slots that stepped
    m: torch.Tensor  # (B,) drafts accepted, -1 where not running
    new_tokens: torch.Tensor  # (B, D+1): the accepted drafts, then the bonus
    advance: torch.Tensor  # (B,) tokens each slot moved on by: m + 1, 0 where not running


class Proposer:
    depth = 0  # D: the longest run of drafts one step can accept
    commits = False  # accepted nodes must be moved into place in the target's cache
    drafter_calls = 0  # drafter steps per step
    state: tuple[str, ...] = ()  # the per-slot state attributes `advance` replaces (a fused step keeps them)

    def __init__(self, runner, dcfg: DecodeConfig, rule: Acceptance, draws, sampling):
        """sampling: the engine's per-slot settings (lantern.engine.slot_sampling.SlotSampling)."""
        self.runner, self.dcfg, self.rule, self.draws = runner, dcfg, rule, draws
        self.sampling = sampling
        self.vocab = runner.model_config.vocab_size

    def reset(self, slots, fresh: torch.Tensor, first: Support, features: torch.Tensor,
              prefix: Optional[PrefixPairs] = None) -> None:
        """(optional) Start the fresh slots' state; default: no state. prefix: what a drafter that reads the
        prefix is fed with the features (None when it reads none)."""

    def distributions(self, logits: torch.Tensor):
        """(R*B, N, V) verify logits -> each image's guided logits, warped where the acceptance reads them."""
        return GuidedLogits(combine_cfg(logits, self.sampling.cfg_scale, self.sampling.use_cfg), self.sampling)

    def accept(self, p_nodes, tree: DraftedTree) -> StepAcceptance:
        return accept(p_nodes, tree, self.rule, self.sampling.greedy, self.draws, self.vocab)

    def advance(self, slots, step: Stepped) -> None:
        """(optional) Move the slots' state on after a step; default: no state."""


class NoProposal(Proposer):
    """Plain AR: the root alone is verified, and the 'bonus' is the next token drawn from p after it."""

    def __init__(self, runner, dcfg, rule, draws, sampling):
        super().__init__(runner, dcfg, rule, draws, sampling)
        dev = runner.device
        self._tree = dict(depth=torch.zeros(1, 1, dtype=torch.long, device=dev),
                          ancestors=torch.ones(1, 1, 1, dtype=torch.bool, device=dev),
                          parents=torch.zeros(1, 0, dtype=torch.long, device=dev),
                          children=torch.zeros(1, 0, 0, dtype=torch.long, device=dev),
                          rank=torch.zeros(1, 1, dtype=torch.long, device=dev))
        self._fixed = None  # what every step of B slots proposes and accepts besides the bonus, made once

    def _constants(self, b: int, dev) -> dict:
        if self._fixed is None:
            long = dict(dtype=torch.long, device=dev)
            zeros = torch.zeros(b, 0, device=dev)
            self._fixed = dict(valid=torch.ones(b, 1, dtype=torch.bool, device=dev), path=torch.zeros(b, 1, **long),
                               accepted=torch.zeros(b, **long), tried=zeros.bool(),
                               token_tv=torch.zeros(b, 1, device=dev), boost=zeros)
        return self._fixed

    def propose(self, slots) -> DraftedTree:
        valid = self._constants(slots.root.shape[0], slots.root.device)["valid"]
        return DraftedTree(tokens=slots.root_tok[:, None], valid=valid, q=None, max_depth=0, **self._tree)

    def accept(self, p_nodes, tree: DraftedTree) -> StepAcceptance:
        fixed = self._constants(tree.tokens.shape[0], tree.tokens.device)
        bonus = draw(p_nodes.index(fixed["path"]), self.sampling.greedy, self.draws)[:, 0]  # node 0: the root
        return StepAcceptance(path=fixed["path"], accepted=fixed["accepted"], bonus=bonus, tried=fixed["tried"],
                              token_tv=fixed["token_tv"], boost=fixed["boost"])


class TreeProposal(Proposer):
    """A drafter's tree: catch-up on the last accepted pairs, then a static tree (LANTERN++) or EAGLE-2's
    dynamic one."""

    commits = True
    state = ("pend_feats", "pend_tokens", "pend_count")

    def __init__(self, runner, dcfg, rule, draws, sampling):
        super().__init__(runner, dcfg, rule, draws, sampling)
        self.strategy = dcfg.strategy
        self.depth, self.drafter_calls = self.strategy.depth, self.strategy.drafter_calls
        self.drafter = DraftRunner(runner, self.sampling, draws)
        self._draft = draft_static if isinstance(self.strategy, StaticTree) else draft_dynamic
        self.pend_feats = self.pend_tokens = self.pend_count = None

    def reset(self, slots, fresh, first, features, prefix=None) -> None:
        if self.runner.spec.draft_prefix:  # a drafter that reads the prefix (LANTERN's): its pairs, every row
            self.drafter.read_prefix(features, prefix)
        a, rows = self.strategy.catchup_width, self.sampling.rows_per_image
        feats = features[:, -1:].repeat(1, a, 1)  # (R*B, A, D) the root's pair, then padding
        tokens = slots.root_tok[:, None].repeat(1, a)
        count = torch.ones_like(slots.root)
        if self.pend_feats is None:
            self.pend_feats, self.pend_tokens, self.pend_count = feats, tokens, count
            return
        self.pend_feats = torch.where(on_rows(fresh, rows)[:, None, None], feats, self.pend_feats)
        self.pend_tokens = torch.where(fresh[:, None], tokens, self.pend_tokens)
        self.pend_count = torch.where(fresh, count, self.pend_count)

    def propose(self, slots) -> DraftedTree:
        with self.runner.phase("draft"):
            q_root, root_feat = self.drafter.catch_up(self.pend_feats, self.pend_tokens, self.pend_count,
                                                      slots.root)
            return self._draft(self.drafter, self.strategy, slots.root_tok, slots.root, q_root, root_feat)

    def advance(self, slots, step: Stepped) -> None:
        hidden, rows = step.out.hidden, self.sampling.rows_per_image
        path = on_rows(step.acc.path, rows)[..., None].expand(-1, -1, hidden.shape[-1])
        self.pend_feats = hidden.gather(1, path)  # the accepted nodes' features: the next catch-up's pairs
        self.pend_tokens = step.new_tokens
        self.pend_count = torch.where(step.running, step.m + 1, self.pend_count)


class WindowProposal(Proposer):
    """Jacobi: the window of L drafts after the root, redrawn every step from the target's p at its positions
    (lantern.decoding.jacobi: SJD, MC-SJD's coupled noise, the spatial prior), verified as a chain whose node i
    sits at its own position (the accepted prefix is in place: no commit), or as the window's tree
    (lantern.decoding.jacobi.WindowTree: the next ranked drafts of the first positions too, each continued by the
    stale tail), whose paths off the chain are committed into place."""

    state = ("q", "drafts", "offered")

    def __init__(self, runner, dcfg, rule, draws, sampling):
        super().__init__(runner, dcfg, rule, draws, sampling)
        strategy, dev = dcfg.strategy, runner.device
        self.window = self.depth = strategy.window
        layout = strategy.tree
        self.ranks = layout.ranks  # ranked drafts a slot offers: the branching candidates, then the fan's
        # a fan past a support cut by top-k or top-p draws from the window's distributions mixed with uncut ones
        self.fan_width = fan_width(layout, sampling, self.vocab)
        self.commits = not layout.is_chain
        self.slots_ahead = torch.arange(1, self.window + 1, device=dev)
        self.grid = runner.model_config.grid_size
        self.above = dcfg.initial == "above"
        self.noise = CoupledNoise() if dcfg.coupling == "gumbel" and not self.sampling.greedy else None
        self.q = self.drafts = self.offered = None
        self.draft_at = layout.draft[1:].to(dev)  # (N-1,) each node's column among the ranked drafts
        self.successor = layout.successor.to(dev)  # (N, 2L + 2)
        self.chain_end = int(layout.successor[0, self.window])  # the chain's last node
        t = layout.compiled
        self.parent_slot = t.node_depth[t.parent_nodes].to(dev)  # (M,) the window slot each parent's children fill
        # a tree's window goes on from the candidate nearest the bonus (the codebook's proximity lists), if any
        self.near = rule.proximity if self.commits else None
        kids_of = torch.full((t.size, t.children_table.shape[1]), -1, dtype=torch.long)
        kids_of[t.parent_nodes] = t.children_table
        self.kids_of = kids_of.to(dev)  # (N, C) each node's children in rank order
        self._tree = dict(depth=t.node_depth.to(dev)[None], ancestors=t.mask.to(dev)[None],
                          parents=t.parent_nodes.to(dev)[None], children=t.children_table.to(dev),
                          rank=t.rank.to(dev)[None], chain=t.is_chain, rows_at_rank=t.rows_at_rank)

    def distributions(self, logits):
        return target_support(logits, self.sampling)  # (B, N, K): every node is a parent

    def _drafts(self, q: Support, emitted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, K) -> the ranked drafts (B, L * ranks) of the image's tokens emitted .. emitted + L - 1 (the
        window after the root), and which are ones. The noise is keyed by the token's index in its image, not by
        its cache position, which a left-padded prompt shifts."""
        at = emitted[:, None] + self.slots_ahead - 1
        g = self.noise.at(at, q.ids, self.draws) if self.noise is not None else None
        tokens, offered = redraw(q, g, self.sampling.greedy, self.draws, self.ranks)
        return tokens.flatten(1), offered.flatten(1)

    def _fanned(self, q: Support, logits: torch.Tensor, nodes: torch.Tensor) -> Support:
        """The window's distributions q (B, L, K), from the verify logits (R*B, N, V) at `nodes` (B, L) -> what a
        fanned window draws from (lantern.decoding.jacobi.fan_drafts): the same logits uncut, top fan_width."""
        at = on_rows(nodes, self.sampling.rows_per_image)
        broad = target_support(logits.gather(1, at[..., None].expand(*at.shape, logits.shape[-1])), self.sampling,
                               broad=self.fan_width)
        return fan_drafts(q, broad, self.vocab)

    def reset(self, slots, fresh, first, features, prefix=None) -> None:
        b = fresh.shape[0]
        q = Support(*(x[:, None].expand(-1, self.window, -1) for x in first))  # never predicted: the last p
        if self.fan_width:
            q = widened(q, self.fan_width, self.vocab)
        if self.above:
            q = spatial_prior(q, torch.ones(b, self.window, dtype=torch.bool, device=fresh.device), slots.out,
                              slots.emitted, self.grid, self.vocab)
        drafts, offered = self._drafts(q, slots.emitted)
        if self.q is None:
            self.q, self.drafts, self.offered = q, drafts, offered
            return
        keep = fresh[:, None, None]
        self.q = Support(torch.where(keep, q.probs, self.q.probs), torch.where(keep, q.ids, self.q.ids))
        self.drafts = torch.where(fresh[:, None], drafts, self.drafts)
        self.offered = torch.where(fresh[:, None], offered, self.offered)

    def propose(self, slots) -> DraftedTree:
        b = slots.root.shape[0]
        q = None
        if not self.sampling.greedy:  # each parent's children were drawn from the window's q at their slot
            q = self.q if self._tree["chain"] else self.q.index(self.parent_slot.expand(b, -1))
        return DraftedTree(tokens=torch.cat([slots.root_tok[:, None], self.drafts[:, self.draft_at]], 1),
                           valid=torch.cat([torch.ones_like(self.offered[:, :1]), self.offered[:, self.draft_at]], 1),
                           q=q, max_depth=self.window, **self._tree)

    def _stand_in(self, step: Stepped, last: torch.Tensor) -> torch.Tensor:
        """(B, 1) the last accepted nodes -> the node whose descendants predict the window: where the bonus was drawn
        after the last node's candidates were rejected, the candidate nearest it in the codebook (its p after a
        token much like the bonus), else the last node. Lossless: the choice reads only decided positions."""
        kids = self.kids_of[last[:, 0]]  # (B, C)
        at = kids.clamp_min(0)
        valid = (kids >= 0) & step.tree.valid.gather(1, at)
        col = nearest_candidate(step.acc.bonus, step.tree.tokens.gather(1, at), valid, self.near)
        return torch.where(valid.any(-1, keepdim=True), kids.gather(1, col[:, None]), last)

    def advance(self, slots, step: Stepped) -> None:
        # window slot w now holds position root + 1 + w; the node predicting it is the one at depth advance + w
        # ahead of the last accepted node, on its rank-0 descendants while they last, then on the window's chain
        b = slots.root.shape[0]
        last = step.acc.path.gather(1, step.acc.accepted.clamp_min(0)[:, None])  # (B, 1)
        origin = last if self.near is None else self._stand_in(step, last)
        ahead = (step.advance[:, None] + self.slots_ahead - 1).clamp(max=self.successor.shape[1] - 1)  # (B, L)
        predicted_by = self.successor[origin.expand(b, self.window), ahead]  # (B, L); -1: no node predicts it yet
        fresh = predicted_by < 0
        # never predicted: the last p on the window's chain (MC-SJD's "last"), or the spatial prior below
        nodes = torch.where(fresh, self.chain_end, predicted_by)
        q = step.p_nodes.index(nodes)
        if self.fan_width:
            q = self._fanned(q, step.out.logits, nodes)
        if self.above:
            q = spatial_prior(q, fresh, slots.out, slots.emitted, self.grid, self.vocab)
        self.q = q
        self.drafts, self.offered = self._drafts(q, slots.emitted)


def make_proposer(runner, dcfg: DecodeConfig, rule: Acceptance, draws, sampling) -> Proposer:
    kind = NoProposal if dcfg.strategy is None else WindowProposal if dcfg.jacobi else TreeProposal
    return kind(runner, dcfg, rule, draws, sampling)
