"""Batched drafting on the runner's device: catch-up, static trees, EAGLE-2 dynamic trees, for B images.

Rows of every step are [cond images; uncond images] (LlamaGen's CFG layout): image b owns rows b and B + b.
Each image has its own root position r (B,), so positions, slots and masks are built per image on the
device; nothing here reads a value back to the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from lantern.decoding.acceptance import DraftedTree
from lantern.decoding.sampling import Draws, SamplingConfig, Support, candidates, target_support
from lantern.decoding.strategy import DynamicTree, LevelPlan, StaticTree


def on_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-image inputs (B, ...) -> per-row (rows * B, ...), dense (graph backends key on strides)."""
    return x.repeat(rows, *([1] * (x.dim() - 1))).contiguous()


def window_mask(relative: torch.Tensor, root: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """relative (B|1, T, X) bool over slots root .. root + X - 1 of each image; base (B, S) bool, the slots
    every row sees. -> (B, T, S): base | relative placed at each image's root."""
    b, s = base.shape
    t, x = relative.shape[-2:]
    rel = torch.arange(s, device=base.device)[None] - root[:, None]  # (B, S)
    inside = (rel >= 0) & (rel < x)
    idx = rel.clamp(0, x - 1)[:, None, :].expand(b, t, s)
    placed = relative.expand(b, t, x).gather(2, idx) & inside[:, None, :]
    return base[:, None, :] | placed


@dataclass(frozen=True)
class PrefixPairs:
    """What a drafter that reads the prefix is fed at prefill besides the features f_0 .. f_{W-1}, per row (R*B, W):
    the drafter token paired with each (Drafter.prefix_tokens) and whether its slot may be attended (False: the
    feature comes from a padded prompt slot, hidden from every drafter query, as the target hides it)."""

    tokens: torch.Tensor
    visible: torch.Tensor


class DrafterSteps(Protocol):
    """What drafting needs of a runner (lantern.backends.base.Runner has it), so the core never imports a backend."""

    spec: Any  # its StaticSpec: batch, max_len, draft_first_slot, draft_prefix
    device: torch.device

    def draft(self, tokens, features, positions, slots, mask) -> Any:
        """The drafter's forward over T (feature, token) pairs into its own cache -> (logits, hidden) by name."""


@dataclass
class DraftRunner:
    """The drafter steps of one runner (lantern.models.drafter.Drafter, prepared by the backend), with the
    sampling that shapes its distributions and the random draws its candidates come from."""

    runner: DrafterSteps
    sampling: SamplingConfig
    generator: Draws
    # (R*B, S) the drafter slots each row may attend, when its cache holds the prefix (padded prompt slots hidden);
    # updated in place at every prefill, so a captured graph reads the current rows
    keys: Optional[torch.Tensor] = field(default=None, init=False)

    def __post_init__(self):
        spec = self.runner.spec
        if spec.draft_prefix:
            self.keys = torch.ones(spec.batch, spec.max_len, dtype=torch.bool, device=self.runner.device)

    @property
    def rows(self) -> int:
        return self.sampling.rows_per_image

    @property
    def slots(self) -> torch.Tensor:
        return torch.arange(self.runner.spec.max_len, device=self.runner.device)

    def committed(self, last: torch.Tensor) -> torch.Tensor:
        """(B,) last committed drafter slot -> (B, S): the drafter's first slot .. last (spec.draft_first_slot: P,
        or 1 for a drafter that reads the prefix; slots below it are empty)."""
        s = self.slots[None]
        return (s >= self.runner.spec.draft_first_slot) & (s <= last[:, None])

    def read_prefix(self, features: torch.Tensor, prefix: PrefixPairs) -> None:
        """Feed the prefix pairs (f_i, prefix.tokens[:, i]), i = 0 .. W-1 (W = spec.draft_prefix, P - 1) at
        positions and slots 1 .. W, causal, as LANTERN feeds its drafters (t2i: token 0, no caption mask; Anole: the
        next prompt token, padded slots hidden from then on); features (R*B, P, D) from the prefill. Every row is
        rewritten (a busy row with what it held)."""
        w, dev, n = self.runner.spec.draft_prefix, self.runner.device, features.shape[0]
        self.keys[:, 1:w + 1] = prefix.visible
        positions = (1 + torch.arange(w, device=dev))[None].expand(n, w).contiguous()  # (R*B, W)
        s = self.slots[None, None]
        causal = (s >= 1) & (s <= positions[..., None])  # (R*B, W, S)
        mask = (causal & self.keys[:, None]) | (s == positions[..., None])  # a hidden slot still sees itself
        self.runner.draft(prefix.tokens.contiguous(), features[:, :w].contiguous(), positions, positions.clone(),
                          mask)  # only its cache is kept

    def step(self, tokens, features, positions, slots, mask):
        """Per image tokens, positions, slots (B, T), mask (B, T, S); features (R*B, T, D) ->
        (distributions (B, T, K), predicted features (R*B, T, D))."""
        r = self.rows
        mask = on_rows(mask, r) if self.keys is None else on_rows(mask, r) & self.keys[:, None, :mask.shape[-1]]
        out = self.runner.draft(on_rows(tokens, r), features.contiguous(), on_rows(positions, r),
                                on_rows(slots, r), mask)
        return target_support(out.logits, self.sampling), out.hidden

    def catch_up(self, features, tokens, count, root):
        """Feed each image's newly accepted pairs: features (R*B, A, D), tokens (B, A), count (B,) real pairs
        ending at position root (B,). Pairs past count are padding at later (scratch) slots.
        Returns the root's draft distribution (B, K) and predicted feature (R*B, D)."""
        a = tokens.shape[1]
        positions = (root - count + 1)[:, None] + torch.arange(a, device=root.device)  # (B, A)
        s = self.slots[None, None]
        mask = (s >= self.runner.spec.draft_first_slot) & (s <= positions[..., None])  # causal (B, A, S)
        q, feats = self.step(tokens, features, positions, positions.clone(), mask)
        last = (count - 1)[:, None]
        q_root = Support(q.probs.gather(1, last[..., None].expand(-1, -1, q.probs.shape[-1]))[:, 0],
                         q.ids.gather(1, last[..., None].expand(-1, -1, q.ids.shape[-1]))[:, 0])
        rows_last = on_rows(last, self.rows)[..., None].expand(-1, -1, feats.shape[-1])
        return q_root, feats.gather(1, rows_last)[:, 0]


def draft_static(d: DraftRunner, strategy: StaticTree, root_token, root: torch.Tensor, q_root: Support,
                 root_feat: torch.Tensor) -> DraftedTree:
    """Child j of a node is its j-th candidate (top-j, or the j-th draw without replacement), whatever the
    drafter's confidence (LANTERN++). root (B,) is the root's position. Each level's candidates, flags, draft
    distributions and predicted features are kept as made and joined once (the plan's static columns): no
    buffer written per level."""
    greedy, gen = d.sampling.greedy, d.generator
    b, dev = root.shape[0], root.device
    placed = strategy.on_device(dev)
    fan_out = placed.children.shape[1]
    tokens, valid = [root_token[:, None]], [torch.ones(b, 1, dtype=torch.bool, device=dev)]  # drafting order
    feats = [root_feat[:, None]]  # (R*B, w, D) predicted features after the root, then each level's nodes
    q_probs, q_ids = [], []  # (B, w, K) each level's draft distributions, by the level's table rows

    def assign(level: LevelPlan, q: Support) -> None:
        """The level's nodes (rows of q (B, w, K)) get their children's candidates."""
        q_probs.append(q.probs)
        q_ids.append(q.ids)
        cand, ok = candidates(q, fan_out, greedy, gen)  # (B, w, C)
        parent_ok = torch.cat(valid, 1)[:, level.node_cols][..., None]
        tokens.append(cand.flatten(1)[:, level.kid_cols])
        valid.append((ok & parent_ok).flatten(1)[:, level.kid_cols])

    plans = placed.levels
    assign(plans[0], Support(q_root.probs[:, None], q_root.ids[:, None]))
    committed = d.committed(root)
    for level in plans[1:]:
        w, width = level.nodes.shape[0], level.rel.shape[0]
        step_tokens = torch.cat([torch.cat(tokens, 1)[:, level.node_cols], root_token.new_zeros(b, width - w)], 1)
        step_feats = torch.cat([torch.cat(feats, 1)[:, level.parent_cols],
                                root_feat[:, None].expand(-1, width - w, -1)], 1)
        positions = (root + level.depth)[:, None].expand(b, width).contiguous()
        slots = root[:, None] + level.offsets
        q, out_feats = d.step(step_tokens, step_feats, positions, slots, window_mask(level.rel[None], root, committed))
        feats.append(out_feats[:, :w])
        assign(level, Support(q.probs[:, :w], q.ids[:, :w]))
    none = [root_token.new_zeros(b, 1)], [torch.zeros(b, 1, dtype=torch.bool, device=dev)]  # padding nodes' column
    tokens, valid = (torch.cat(x + pad, 1)[:, placed.node_order] for x, pad in zip((tokens, valid), none))
    q = None if greedy else Support(*(torch.cat(x, 1)[:, placed.row_order] for x in (q_probs, q_ids)))
    return DraftedTree(tokens=tokens, valid=valid, depth=placed.depth, ancestors=placed.ancestors,
                       parents=placed.parents, children=placed.children[None], q=q, max_depth=strategy.depth,
                       rank=placed.rank, chain=placed.chain, rows_at_rank=placed.rows_at_rank)


def draft_dynamic(d: DraftRunner, strategy: DynamicTree, root_token, root: torch.Tensor, q_root: Support,
                  root_feat: torch.Tensor) -> DraftedTree:
    """EAGLE-2 per image: beams by cumulative draft log-probability, then the `total` best nodes (drafts are
    deterministic top-k, so q is a point mass on each candidate). Records (the root, the root's top_k, then top_k
    children of each beam per level) are made level by level and joined once: no buffer written per level."""
    k, depth, gen = strategy.top_k, strategy.max_depth, d.generator
    b, dev = root.shape[0], root.device
    # each level's records (B, w * k): token, parent record, cumulative log-probability; the root is record 0
    tok, par, score = [root_token[:, None]], [root.new_zeros(b, 1)], [torch.zeros(b, 1, device=dev)]
    expanded = [root.new_zeros(b, 1)]  # record ids that get children, root first

    def add_children(parent_recs: torch.Tensor, parent_scores: torch.Tensor, q: Support) -> None:
        """The next level's records: the top-k candidates of each parent (B, w)."""
        cand, ok = candidates(q, k, True, gen)  # (B, w, k)
        logq = torch.where(ok, q.prob_of(cand).log(), float("-inf"))
        tok.append(cand.flatten(1))
        par.append(parent_recs[..., None].expand(-1, -1, k).flatten(1))
        score.append((parent_scores[..., None] + logq).flatten(1))

    root_support = Support(q_root.probs[:, None], q_root.ids[:, None])
    add_children(par[0], score[0], root_support)
    committed = d.committed(root)
    frontier_mask = committed[:, None].expand(b, k, -1)  # slots each frontier node's ancestors occupy
    parent_feats = root_feat[:, None].expand(-1, k, -1)
    prev_feats = parent_feats  # (R*B, k, D) the previous level's predicted features
    first_of_level = 1
    for level in range(1, depth):
        best = torch.topk(score[-1], k, dim=-1)  # (B, k) best beams of this level
        pick = best.indices
        recs = first_of_level + pick
        expanded.append(recs)
        if level > 1:  # the beam's parent is a frontier node of the previous level
            from_beam = pick // k
            frontier_mask = frontier_mask.gather(1, from_beam[..., None].expand(-1, -1, frontier_mask.shape[-1]))
            beam_rows = on_rows(from_beam, d.rows)[..., None].expand(-1, -1, prev_feats.shape[-1])
            parent_feats = prev_feats.gather(1, beam_rows)
        slots = root[:, None] + 1 + (level - 1) * k + torch.arange(k, device=dev)  # (B, k) scratch
        own = torch.zeros_like(frontier_mask).scatter_(2, slots[..., None], True)
        frontier_mask = frontier_mask | own
        positions = (root + level)[:, None].expand(b, k).contiguous()
        q, prev_feats = d.step(tok[-1].gather(1, pick), parent_feats, positions, slots, frontier_mask)
        first_of_level += score[-1].shape[1]
        add_children(recs, best.values, q)
    return _rerank(strategy, *(torch.cat(x, 1) for x in (tok, par, score, expanded)))


def _rerank(strategy: DynamicTree, tok, par, score, expanded) -> DraftedTree:
    """Keep the total - 1 best records (a child never outscores its parent and ties go to the earlier record,
    i.e. the shallower: the kept set is a tree), number them as nodes 1.. in score order."""
    b, n_rec = tok.shape
    n, k, dev = strategy.total, strategy.top_k, tok.device
    order = torch.sort(score[:, 1:], dim=-1, descending=True, stable=True).indices + 1
    chosen = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), order[:, : n - 1]], 1)  # (B, N) records
    node_of = torch.full((b, n_rec), -1, dtype=torch.long, device=dev)
    node_of.scatter_(1, chosen, torch.arange(n, device=dev).expand(b, n))
    parent = node_of.gather(1, par.gather(1, chosen))  # (B, N); the root's parent is itself
    valid = torch.isfinite(score.gather(1, chosen)) & (parent >= 0)
    parent = parent.clamp_min(0)
    # j is an ancestor of i (or i) iff it is i's parent taken l times, l = 0 .. max_depth (the root is its own)
    up = [torch.arange(n, device=dev).expand(b, n)]
    for _ in range(strategy.max_depth):
        up.append(parent.gather(1, up[-1]))
    ancestors = (torch.stack(up, -1)[:, :, None, :] == torch.arange(n, device=dev)[:, None]).any(-1)  # (B, N, N)
    # children of every expanded record: the root's are records 1..k, beam e's a block of k after them
    blocks = torch.cat([torch.arange(1, 1 + k, device=dev)[None].expand(b, k)[:, None],
                        _child_blocks(strategy, expanded[:, 1:])], 1)  # (B, M, k) record ids
    children = node_of.gather(1, blocks.flatten(1)).view(b, -1, k)
    parents = node_of.gather(1, expanded)
    record = torch.arange(n_rec, device=dev)  # the root, its k children (depth 1), then k * k per deeper level
    rec_depth = torch.where(record <= k, (record > 0).long(), 2 + (record - 1 - k).div(k * k, rounding_mode="floor"))
    rank = torch.where(record > 0, (record - 1) % k, 0)
    return DraftedTree(tokens=tok.gather(1, chosen), valid=valid, depth=rec_depth[chosen], ancestors=ancestors,
                       parents=parents, children=children, q=None, max_depth=strategy.max_depth,
                       rank=rank[chosen])


def _child_blocks(strategy: DynamicTree, beams: torch.Tensor) -> torch.Tensor:
    """(B, (D-1)*k) beam record ids -> (B, (D-1)*k, k) the record ids of each beam's children."""
    k = strategy.top_k
    level = torch.arange(beams.shape[1], device=beams.device) // k  # 0-based: beams of depth level + 1
    beam_in_level = torch.arange(beams.shape[1], device=beams.device) % k
    base = 1 + k + level * k * k + beam_in_level * k
    return (base[:, None] + torch.arange(k, device=beams.device))[None].expand(beams.shape[0], -1, -1)
