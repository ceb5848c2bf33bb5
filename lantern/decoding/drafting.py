"""Drafting a token tree with the EAGLE-style drafter: catch-up, static trees, EAGLE-2 dynamic trees.

Drafter cache layout (per row): the pair (f_{q-1}, x_q) lives at slot q, its sequence position; slots
below the prefix length are never written and are masked out. While a tree is drafted, drafted nodes use
scratch slots past the root (root position r + 1 + j), which the next catch-up overwrites.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lantern.backends.base import Runner
from lantern.decoding.sampling import SamplingConfig, combine_cfg, warp
from lantern.decoding.trees import CompiledTree, compile_tree


@dataclass
class DraftContext:
    runner: Runner
    sampling: SamplingConfig
    prefix_len: int
    catchup_width: int  # A: the most pairs one catch-up feeds (tree depth + 1)
    draft_width: int  # W: the most nodes one tree-drafting step feeds
    generator: torch.Generator
    draft_calls: int = 0

    @property
    def rows(self) -> int:
        return self.sampling.rows_per_image

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(R, T, V) drafter logits -> (T, V) draft distribution, guided and warped like the target's."""
        guided = combine_cfg(logits.float().cpu(), self.sampling.cfg_scale, self.sampling.use_cfg)  # (1, T, V)
        return warp(guided[0], self.sampling)

    def step(self, tokens, features, positions, slots, mask):
        """Pad to the static width W, run, return (probs (T, V), feats (R, T, D)) of the real rows."""
        t = tokens.shape[0]
        out = run_padded(self.runner, self.draft_width, tokens, features, positions, slots, mask, self.rows)
        self.draft_calls += 1
        return self.probs(out.logits[:, :t]), out.hidden[:, :t]


def run_padded(runner: Runner, width: int, tokens, features, positions, slots, mask, rows: int):
    """Feed T <= width real pairs (tokens, positions, slots (T,); features (R, T, D); mask (T, S)) as one
    step of exactly `width`. Padding pairs write to slots past every real one, which callers never read."""
    t, s = tokens.shape[0], mask.shape[-1]
    dev = runner.device
    pad = width - t
    if pad:
        pad_slots = slots.max() + 1 + torch.arange(pad)
        slots = torch.cat([slots, pad_slots])
        positions = torch.cat([positions, positions[-1:].expand(pad)])
        tokens = torch.cat([tokens, tokens.new_zeros(pad)])
        features = torch.cat([features, features[:, -1:].expand(-1, pad, -1)], dim=1)
        own = torch.zeros(pad, s, dtype=torch.bool)
        own[torch.arange(pad), pad_slots] = True  # a padding pair sees only itself
        mask = torch.cat([mask, own])
    return runner.draft(on_rows(tokens, rows, dev), features.contiguous().to(dev), on_rows(positions, rows, dev),
                        on_rows(slots, rows, dev), on_rows(mask, rows, dev))


def on_rows(x: torch.Tensor, rows: int, device) -> torch.Tensor:
    """The same tree input for every CFG row: (...) -> (rows, ...), dense (graph backends key on strides)."""
    return x[None].expand(rows, *x.shape).contiguous().to(device)


def catch_up(ctx: DraftContext, features: torch.Tensor, tokens: torch.Tensor, start: int):
    """Feed the newly accepted pairs (features (R, n, D), tokens (n,)) at positions start..start+n-1.
    Returns the root's draft distribution (V,) and predicted feature (R, D)."""
    n = tokens.shape[0]
    s = ctx.runner.spec.max_len
    positions = start + torch.arange(n)
    slot_ids = torch.arange(s)
    mask = (slot_ids[None, :] >= ctx.prefix_len) & (slot_ids[None, :] <= positions[:, None])  # (n, S) causal
    out = run_padded(ctx.runner, ctx.catchup_width, tokens, features, positions, positions, mask, ctx.rows)
    ctx.draft_calls += 1
    return ctx.probs(out.logits[:, n - 1:n])[0], out.hidden[:, n - 1]


@dataclass
class DraftedTree:
    tree: CompiledTree
    tokens: torch.Tensor  # (N,) node tokens, root first
    valid: torch.Tensor  # (N,) bool: padding and missing candidates are never accepted
    q: Optional[torch.Tensor]  # (N, V) distribution each node's children were sampled from; None = top-k


def _candidates(ctx: DraftContext, q: torch.Tensor, n: int) -> torch.Tensor:
    """The n children of a node: top-n (greedy) or n draws without replacement (sampling)."""
    n = min(n, int((q > 0).sum()))
    if ctx.sampling.greedy:
        return torch.topk(q, n).indices
    return torch.multinomial(q, n, replacement=False, generator=ctx.generator)


def _tree_mask_rows(ctx: DraftContext, tree: CompiledTree, nodes: list[int], root_pos: int) -> torch.Tensor:
    """(len(nodes), S): committed drafter slots up to the root, plus the scratch slots of each node's
    drafted ancestors and itself (node j sits at scratch slot root_pos + j)."""
    s = ctx.runner.spec.max_len
    slot_ids = torch.arange(s)
    mask = ((slot_ids >= ctx.prefix_len) & (slot_ids <= root_pos))[None].repeat(len(nodes), 1)
    n = tree.size
    mask[:, root_pos + 1: root_pos + n] = tree.mask[nodes, 1:]
    return mask


def draft_static(ctx: DraftContext, tree: CompiledTree, root_token: int, root_q: torch.Tensor,
                 root_feat: torch.Tensor, root_pos: int) -> DraftedTree:
    """Child j of a node is its j-th candidate, whatever the drafter's confidence (LANTERN++)."""
    n = tree.size
    tokens = torch.zeros(n, dtype=torch.long)
    valid = torch.zeros(n, dtype=torch.bool)
    tokens[0], valid[0] = root_token, True
    q_nodes = None if ctx.sampling.greedy else torch.zeros(n, root_q.shape[0])
    feats = {0: root_feat}  # node -> predicted feature (R, D) that its children's pairs carry

    def assign_children(node: int, q: torch.Tensor) -> None:
        kids = tree.children[node]
        cand = _candidates(ctx, q, len(kids))
        for c, tok in zip(kids, cand.tolist()):
            tokens[c], valid[c] = tok, True
        if q_nodes is not None:
            q_nodes[node] = q

    assign_children(0, root_q)
    for level in tree.draft_levels:
        nodes = [i for i in level if valid[i]]
        if not nodes:
            break
        depth = int(tree.node_depth[nodes[0]])
        parent_feats = torch.stack([feats[int(tree.parent[i])] for i in nodes], dim=1)  # (R, w, D)
        probs, out_feats = ctx.step(tokens[nodes], parent_feats, torch.full((len(nodes),), root_pos + depth),
                                    root_pos + torch.tensor(nodes), _tree_mask_rows(ctx, tree, nodes, root_pos))
        for j, i in enumerate(nodes):
            feats[i] = out_feats[:, j]
            assign_children(i, probs[j])
    return DraftedTree(tree, tokens, valid, q_nodes)


def draft_dynamic(ctx: DraftContext, depth: int, top_k: int, total: int, root_token: int, root_q: torch.Tensor,
                  root_feat: torch.Tensor, root_pos: int) -> DraftedTree:
    """EAGLE-2: expand the top_k nodes by cumulative draft log-prob at each depth, then keep the `total`
    best of all drafted nodes (root included); drafts are deterministic top-k, so q is a point mass."""
    # node records: token, parent record id, cumulative score, depth, scratch slot (if expanded)
    tok, par, score, dep = [root_token], [-1], [0.0], [0]
    slot: dict[int, int] = {}
    feat = {0: root_feat}
    s = ctx.runner.spec.max_len
    slot_ids = torch.arange(s)

    def add_children(node: int, q: torch.Tensor) -> list[int]:
        top = torch.topk(q, min(top_k, int((q > 0).sum())))
        ids = []
        for t, lp in zip(top.indices.tolist(), torch.log(top.values).tolist()):
            tok.append(t), par.append(node), score.append(score[node] + lp), dep.append(dep[node] + 1)
            ids.append(len(tok) - 1)
        return ids

    frontier = add_children(0, root_q)
    next_slot = root_pos + 1
    for d in range(1, depth):
        frontier = sorted(frontier, key=lambda i: -score[i])[:top_k]
        for i in frontier:
            slot[i], next_slot = next_slot, next_slot + 1
        mask = ((slot_ids >= ctx.prefix_len) & (slot_ids <= root_pos))[None].repeat(len(frontier), 1)
        for row, i in enumerate(frontier):
            a = i
            while a > 0:  # the node and its drafted ancestors, all expanded, all with scratch slots
                mask[row, slot[a]] = True
                a = par[a]
        parent_feats = torch.stack([feat[par[i]] for i in frontier], dim=1)
        probs, out_feats = ctx.step(torch.tensor([tok[i] for i in frontier]), parent_feats,
                                    torch.full((len(frontier),), root_pos + d), torch.tensor([slot[i] for i in frontier]),
                                    mask)
        new = []
        for j, i in enumerate(frontier):
            feat[i] = out_feats[:, j]
            new += add_children(i, probs[j])
        frontier = new
    return _rerank(tok, par, score, dep, total)


def _rerank(tok, par, score, dep, total: int) -> DraftedTree:
    """Keep the best `total - 1` drafted nodes (a child never outscores its parent, so the set is a tree;
    ties are broken parent-first), order siblings by score, compile at the static size `total`."""
    order = sorted(range(1, len(tok)), key=lambda i: (-score[i], dep[i], i))
    chosen: set[int] = {0}
    for i in order:
        if len(chosen) == total:
            break
        if par[i] in chosen:
            chosen.add(i)
    kids: dict[int, list[int]] = {}
    for i in sorted(chosen - {0}, key=lambda i: (-score[i], i)):
        kids.setdefault(par[i], []).append(i)
    path_of = {0: ()}
    stack = [0]
    while stack:
        node = stack.pop()
        for rank, c in enumerate(kids.get(node, [])):
            path_of[c] = path_of[node] + (rank,)
            stack.append(c)
    paths = [p for p in path_of.values() if p]
    tree = compile_tree(paths, pad_to=total)
    record = {p: i for i, p in path_of.items()}
    tokens = torch.zeros(total, dtype=torch.long)
    valid = torch.zeros(total, dtype=torch.bool)
    tokens[0], valid[0] = tok[0], True
    for idx, p in enumerate(tree.paths, start=1):
        tokens[idx], valid[idx] = tok[record[p]], True
    return DraftedTree(tree, tokens, valid, None)
