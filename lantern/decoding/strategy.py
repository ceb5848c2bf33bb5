"""Drafting strategies: each owns its static widths, its depth and its scratch layout.

`static_spec` (lantern.engine.step) and the profile suite derive every shape from these, never from the
method's name. The core pads every call to exactly these widths, so graph backends capture each step once.

Cache layout per image row: the committed sequence fills slots 0 .. r-1 of the target cache (r = the root's
position: the last accepted token, not yet in the cache); a verify writes its N nodes at slots r .. r+N-1.
The drafter's cache holds the pair (f_{q-1}, x_q) at slot q; drafted nodes use scratch slots past the root,
which the next catch-up overwrites. `scratch` is how many slots past the last image token a strategy needs.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from functools import cached_property
from typing import ClassVar

import torch

from lantern.decoding.jacobi import WindowTree
from lantern.decoding.trees import CompiledTree


class Strategy(ABC):
    depth_name: ClassVar[str] = "tree depth"  # what `depth` is called in messages

    @property
    @abstractmethod
    def verify_width(self) -> int:
        """N: root + drafted nodes per target forward."""

    @property
    @abstractmethod
    def depth(self) -> int:
        """D: the longest run of drafts one step can accept."""

    @property
    def draft_widths(self) -> tuple[int, ...]:
        """Widths of the drafter steps (empty: no drafter)."""
        return ()

    @property
    def scratch(self) -> int:
        """Cache slots past the sequence that drafting and verification write to."""
        return self.verify_width + max(self.draft_widths, default=0)

    @property
    def commit_pairs(self) -> int:
        """Slot pairs per commit: the root and up to D accepted nodes."""
        return self.depth + 1

    @property
    def catchup_width(self) -> int:
        """Pairs the drafter eats after a step: the accepted drafts and the bonus token."""
        return self.depth + 1

    @property
    def drafter_calls(self) -> int:
        """Drafter steps per verification (0 without a drafter)."""
        return 0

    @property
    def level_width(self) -> int:
        """W: nodes fed per drafter step (0 without a drafter)."""
        return 0



@dataclass(frozen=True)
class LevelPlan:
    """One drafting level of a static tree: which nodes it feeds, where their children go (all static)."""

    nodes: torch.Tensor  # (w,) node ids fed at this level (the root alone for level 0)
    rows: torch.Tensor  # (w,) their rows in the tree's children table
    parents: torch.Tensor  # (w,) their parents' node ids (whose predicted features they carry)
    kids: torch.Tensor  # (c,) child node ids, in the order of kid_cols
    kid_cols: torch.Tensor  # (c,) columns of the flattened (w * C) candidate table that are real children
    depth: int  # the nodes' depth
    offsets: torch.Tensor  # (W,) scratch slot offsets from the root: node ids, then padding past the tree
    rel: torch.Tensor  # (W, N + W) bool: the scratch slots each fed pair attends to (padding: only itself)
    # drafting joins each level's results once instead of writing them into per-node buffers: the columns where
    # this level's nodes sit among the drafted tokens so far (the root, then each level's kids in order) and where
    # their parents sit among the predicted features so far (the root, then each drafter step's nodes in order)
    node_cols: torch.Tensor  # (w,)
    parent_cols: torch.Tensor  # (w,)

    def to(self, device) -> "LevelPlan":
        return LevelPlan(**{f.name: getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
                            else getattr(self, f.name) for f in fields(self)})


@dataclass(frozen=True)
class PlacedTree:
    """A static tree's buffers on one device: (1, N) / (1, N, N) / (1, M) shared by every image."""

    levels: list
    depth: torch.Tensor
    ancestors: torch.Tensor
    parents: torch.Tensor
    children: torch.Tensor  # (M, C)
    rank: torch.Tensor
    chain: bool  # CompiledTree.is_chain
    rows_at_rank: tuple[int, ...]  # CompiledTree.rows_at_rank
    node_order: torch.Tensor  # (N,) each node's column among the drafted tokens (padding: the one past them all)
    row_order: torch.Tensor  # (M,) each children-table row's column among the levels' draft distributions


@dataclass(frozen=True)
class StaticTree(Strategy):
    """A fixed tree shared by every image (LANTERN++, EAGLE-1): child j of a node is its j-th candidate."""

    tree: CompiledTree

    @property
    def verify_width(self) -> int:
        return self.tree.size

    @property
    def depth(self) -> int:
        return self.tree.depth

    @property
    def level_width(self) -> int:
        """W: nodes with children at one depth >= 1 (one drafter step each)."""
        return max(self.tree.draft_width, 1)

    @property
    def draft_widths(self) -> tuple[int, ...]:
        return tuple(sorted({self.catchup_width, self.level_width}))

    @property
    def drafter_calls(self) -> int:
        return 1 + len(self.tree.draft_levels)  # the catch-up, then one per level

    def on_device(self, device) -> "PlacedTree":
        """The tree's buffers and level plans on `device`, moved once and reused every step."""
        cache = self.__dict__.setdefault("_placed", {})
        key = str(device)
        if key not in cache:
            t = self.tree
            drafted = [0] + [int(i) for plan in self.levels for i in plan.kids]  # nodes in drafting order
            column = {node: c for c, node in enumerate(drafted)}
            node_order = torch.tensor([column.get(i, len(drafted)) for i in range(t.size)])
            rows = [int(r) for plan in self.levels for r in plan.rows]  # table rows in drafting order
            row_order = torch.tensor([rows.index(r) for r in range(t.children_table.shape[0])])
            cache[key] = PlacedTree(levels=[plan.to(device) for plan in self.levels],
                                    depth=t.node_depth.to(device)[None], ancestors=t.mask.to(device)[None],
                                    parents=t.parent_nodes.to(device)[None], children=t.children_table.to(device),
                                    rank=t.rank.to(device)[None], chain=t.is_chain, rows_at_rank=t.rows_at_rank,
                                    node_order=node_order.to(device), row_order=row_order.to(device))
        return cache[key]

    @cached_property
    def levels(self) -> list[LevelPlan]:
        """Level 0 (the root, fed by the catch-up) then one plan per drafter step."""
        tree = self.tree
        n, width = tree.size, self.level_width
        row_of = {int(p): i for i, p in enumerate(tree.parent_nodes)}
        table = tree.children_table
        plans = []
        drafted, fed = [0], [0]  # nodes in the order drafting makes their tokens, and their predicted features
        for nodes in [(0,)] + list(tree.draft_levels):
            w = len(nodes)
            kids = table[[row_of[i] for i in nodes]].flatten()
            rel = torch.zeros(width, n + width, dtype=torch.bool)
            rel[:w, :n] = tree.mask[list(nodes)]
            rel[torch.arange(w, width), n + torch.arange(w, width)] = True
            parents = tree.parent[list(nodes)].clamp_min(0)
            plans.append(LevelPlan(
                nodes=torch.tensor(nodes), rows=torch.tensor([row_of[i] for i in nodes]),
                parents=parents, kids=kids[kids >= 0],
                kid_cols=torch.nonzero(kids >= 0).flatten(), depth=int(tree.node_depth[nodes[0]]),
                offsets=torch.cat([torch.tensor(nodes), n + torch.arange(w, width)]), rel=rel,
                node_cols=torch.tensor([drafted.index(i) for i in nodes]),
                parent_cols=torch.tensor([fed.index(int(i)) for i in parents])))
            drafted += [int(i) for i in kids[kids >= 0]]
            if nodes != (0,):
                fed += list(nodes)
        return plans


@dataclass(frozen=True)
class DynamicTree(Strategy):
    """EAGLE-2, per image: expand the top_k beams by cumulative draft log-probability at each depth, keep the
    `total` best drafted nodes (root included)."""

    max_depth: int
    top_k: int
    total: int

    @property
    def verify_width(self) -> int:
        return self.total

    @property
    def depth(self) -> int:
        return self.max_depth

    @property
    def draft_widths(self) -> tuple[int, ...]:
        return tuple(sorted({self.catchup_width, self.top_k}))

    @property
    def drafter_calls(self) -> int:
        return self.max_depth  # the catch-up, then one per depth 1 .. D-1

    @property
    def level_width(self) -> int:
        """W: beams fed per drafter step."""
        return self.top_k

    @property
    def records(self) -> int:
        """Drafted candidates before reranking: the root, its top_k, then top_k**2 per deeper level."""
        return 1 + self.top_k + (self.max_depth - 1) * self.top_k ** 2

    @property
    def expanded(self) -> int:
        """Nodes that get children: the root and top_k beams per depth 1 .. D-1."""
        return 1 + (self.max_depth - 1) * self.top_k

    @property
    def scratch(self) -> int:
        return max(self.total, 1 + (self.max_depth - 1) * self.top_k) + self.catchup_width


@dataclass(frozen=True)
class JacobiWindow(Strategy):
    """Speculative Jacobi decoding: the root and a window of L drafts after it, verified as one causal chain.
    No drafter: each draft is drawn from the target's own distribution at its position from the previous step.
    Chain node i sits at slot root + i = its own position, so accepted nodes' cache entries are already where
    they belong and a plain window never commits (commit_pairs 1: the runner's commit shape, never called).
    With branching > 1 the window also verifies more candidates at its first depths, a small tree continued by
    the stale tail (lantern.decoding.jacobi.WindowTree); a path off the chain is committed into place like a
    drafter tree's."""

    window: int
    branching: int = 1
    branch_depth: int = 1
    tail: int = 0
    fan: int = 0
    depth_name: ClassVar[str] = "window"

    @cached_property
    def tree(self) -> WindowTree:
        return WindowTree(self.window, self.branching, self.branch_depth, self.tail, self.fan)

    @property
    def verify_width(self) -> int:
        return self.tree.size

    @property
    def depth(self) -> int:
        return self.window

    @property
    def commit_pairs(self) -> int:
        return 1 if self.tree.is_chain else self.window + 1
