"""Static token trees as data: Medusa/EAGLE path lists, named presets, one pure compile function.

A path is a tuple of child ranks from the root: (0,) is the root's best candidate, (0, 1) that node's
second candidate. Node 0 of a compiled tree is the root (the last accepted token, not yet in the cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from lantern.files.reading import read_json

Paths = tuple[tuple[int, ...], ...]


def _chain(depth: int) -> Paths:
    return tuple((0,) * d for d in range(1, depth + 1))


# LANTERN++-style static tree: 57 nodes, depth 5, nodes per depth 5/13/16/14/9, child ranks 0..4.
_LANTERN_PP_57: Paths = (
    (0,), (1,), (2,), (3,), (4,),
    (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 1, 3),
    (1, 0, 0), (1, 0, 1), (1, 0, 2), (0, 2, 0), (0, 2, 1), (2, 0, 0), (1, 1, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 3), (0, 0, 0, 4), (0, 0, 1, 0), (0, 0, 1, 1),
    (0, 0, 1, 2), (0, 1, 0, 0), (0, 1, 0, 1), (0, 1, 0, 2), (1, 0, 0, 0), (1, 0, 0, 1), (0, 0, 2, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 2), (0, 0, 0, 0, 3), (0, 0, 0, 1, 0), (0, 0, 0, 1, 1),
    (0, 0, 1, 0, 0), (0, 1, 0, 0, 0), (0, 0, 0, 2, 0),
)

# EAGLE-1-like: 25 nodes, depth 4, most of the width at the first two depths.
_EAGLE1_25: Paths = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 2, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0),
)

# Wide and shallow: 63 nodes, depth 3 (10 / 30 / 23), for devices where wide verification is cheap.
_WIDE_63: Paths = (
    tuple((r,) for r in range(10))
    + tuple((a, b) for a, n in enumerate((6, 5, 4, 4, 3, 2, 2, 2, 1, 1)) for b in range(n))
    + tuple((a, b, c) for (a, b), n in zip(((0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (1, 1), (0, 3), (3, 0)),
                                             (5, 4, 4, 3, 3, 2, 1, 1)) for c in range(n))
)

TREE_PRESETS: dict[str, Paths] = {
    "chain-5": _chain(5),
    "eagle1-25": _EAGLE1_25,
    "lantern++-57": _LANTERN_PP_57,
    "wide-63": _WIDE_63,
}


def validate_paths(paths: Sequence[Sequence[int]], max_nodes: int | None = None,
                   max_depth: int | None = None) -> Paths:
    """Normalise to sorted tuples; raise ValueError naming the bad path and what is allowed."""
    if not paths:
        raise ValueError("a tree needs at least one path, e.g. [[0]]")
    norm = []
    for p in paths:
        if not isinstance(p, (list, tuple)) or not p or not all(isinstance(r, int) and r >= 0 for r in p):
            raise ValueError(f"tree path {p!r} must be a non-empty list of child ranks (ints >= 0)")
        norm.append(tuple(p))
    seen = set()
    for p in norm:
        if p in seen:
            raise ValueError(f"tree path {list(p)} appears twice")
        seen.add(p)
    for p in norm:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"tree is not prefix-closed: {list(p)} has no parent path {list(p[:-1])}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise ValueError(f"tree path {list(p)} skips rank {p[-1] - 1}: sibling ranks must be 0, 1, 2, ... "
                             "(child j is the parent's j-th candidate)")
    if max_nodes is not None and len(norm) + 1 > max_nodes:
        raise ValueError(f"tree has {len(norm) + 1} nodes with the root; the prepared maximum is {max_nodes}")
    depth = max(len(p) for p in norm)
    if max_depth is not None and depth > max_depth:
        raise ValueError(f"tree depth {depth} exceeds the prepared maximum {max_depth}")
    return tuple(sorted(norm, key=lambda p: (len(p), p)))


def load_tree(spec: str) -> Paths:
    """A preset name, or a JSON file holding a list of paths."""
    if spec in TREE_PRESETS:
        return TREE_PRESETS[spec]
    path = Path(spec)
    if not path.suffix == ".json" or not path.exists():
        raise ValueError(f"tree {spec!r} is neither a preset ({', '.join(TREE_PRESETS)}) nor a .json file of paths")
    return validate_paths(read_json(path, "tree file"))


@dataclass(frozen=True)
class CompiledTree:
    """Buffers of a tree padded to `size` nodes (root + drafted + padding)."""

    paths: Paths
    size: int  # N, the static verify width
    n_real: int  # root + real nodes; nodes >= n_real are padding, never accepted
    depth: int  # deepest real node
    parent: torch.Tensor  # (N,) int64, -1 for the root and padding
    node_depth: torch.Tensor  # (N,) int64 position offset from the root (padding: 0)
    rank: torch.Tensor  # (N,) int64 child rank (root, padding: -1)
    mask: torch.Tensor  # (N, N) bool: i attends to j iff j is i or an ancestor of i
    children: tuple[tuple[int, ...], ...]  # per node, child node ids in rank order
    retrieve: torch.Tensor  # (leaves, depth+1) node ids along each root-to-leaf path, padded with -1
    draft_levels: tuple[tuple[int, ...], ...]  # per depth 1..depth-1, the nodes that have children
    parent_nodes: torch.Tensor  # (M,) int64 the nodes that have children, root first
    children_table: torch.Tensor  # (M, C) int64 their children in rank order, -1 padded

    @property
    def draft_width(self) -> int:
        return max((len(level) for level in self.draft_levels), default=0)

    @property
    def max_children(self) -> int:
        return max(len(c) for c in self.children)

    @property
    def rows_at_rank(self) -> tuple[int, ...]:
        """Per child rank j, n_j: the children table's first n_j rows hold every parent with a j-th child, so
        acceptance at rank j reads only them (a tree's rows, root first, branch widely near the root). n_j drops
        only where it at least halves the rows: each drop costs a few ops a step, worth it for a wide fan at the
        root, not for a tree whose rows thin out slowly (LANTERN++'s is read whole)."""
        counts = [len(self.children[int(node)]) for node in self.parent_nodes]
        rows, out = len(counts), []
        for j in range(self.children_table.shape[1]):
            need = 1 + max(row for row, n in enumerate(counts) if n > j)
            rows = need if 2 * need <= rows else rows
            out.append(rows)
        return tuple(out)

    @property
    def is_chain(self) -> bool:
        """Node i's one child is node i + 1 and there is no padding (acceptance's path is then a prefix)."""
        return self.n_real == self.size and all(c == ((i + 1,) if i + 1 < self.size else ())
                                                for i, c in enumerate(self.children))


def compile_tree(paths: Sequence[Sequence[int]], pad_to: int | None = None) -> CompiledTree:
    """Pure: paths -> buffers. `pad_to` runs a smaller tree in a prepared larger static shape."""
    paths = validate_paths(paths, max_nodes=pad_to)
    n_real = len(paths) + 1
    size = pad_to or n_real
    index = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
    parent = torch.full((size,), -1, dtype=torch.long)
    depth = torch.zeros(size, dtype=torch.long)
    rank = torch.full((size,), -1, dtype=torch.long)
    mask = torch.eye(size, dtype=torch.bool)
    children: list[list[int]] = [[] for _ in range(size)]
    for p, i in index.items():
        if not p:
            continue
        par = index[p[:-1]]
        parent[i], depth[i], rank[i] = par, len(p), p[-1]
        children[par].append(i)  # paths are sorted, so ranks arrive in order
        mask[i] = mask[par]
        mask[i, i] = True
    leaves = [i for i in range(1, n_real) if not children[i]] or [0]
    max_depth = max(len(p) for p in paths)
    retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        chain = [leaf]
        while parent[chain[-1]] >= 0:
            chain.append(int(parent[chain[-1]]))
        retrieve[row, : len(chain)] = torch.tensor(chain[::-1])
    parents = [i for i in range(n_real) if children[i]]
    fan_out = max(len(children[i]) for i in parents)
    table = torch.tensor([children[i] + [-1] * (fan_out - len(children[i])) for i in parents], dtype=torch.long)
    levels = tuple(tuple(i for i in range(1, n_real) if depth[i] == d and children[i])
                   for d in range(1, max_depth))
    return CompiledTree(paths=paths, size=size, n_real=n_real, depth=max_depth, parent=parent, node_depth=depth,
                        rank=rank, mask=mask, children=tuple(tuple(c) for c in children), retrieve=retrieve,
                        draft_levels=levels, parent_nodes=torch.tensor(parents, dtype=torch.long),
                        children_table=table)
