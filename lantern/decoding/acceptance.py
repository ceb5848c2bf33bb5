"""Acceptance: which drafted children a target distribution keeps, walking a tree from its root.

Rules (see ALGORITHMS.md section 3):
- exact: recursive rejection sampling, lossless; greedy: the argmax only.
- lantern: p~(x) = p(x) + C_m*(x), m* = max{m <= k : C_m <= delta}   (additive, delta in [0, 1]).
- lantern++: the same with the bound (lam - 1) * p(x)                  (multiplicative, lam >= 1).
where C_m = sum of p over x's m nearest codebook neighbours. delta = 0, lam = 1 or k = 0 is exact.
On a relaxed rejection the residual is the exact rule's, normalise(max(p - q_i, 0)); the neighbours are
not zeroed as the reference code does (both keep the output within delta in a toy test; this one keeps
delta = 0 identical to the exact rule draw for draw).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

KINDS = ("exact", "lantern", "lantern++")


def check_rule(kind: str, k: int, delta: float, lam: float) -> None:
    """Refuse bad acceptance parameters, naming the value and what is allowed."""
    if kind not in KINDS:
        raise ValueError(f"unknown acceptance {kind!r}; allowed: {', '.join(KINDS)}")
    if not 0.0 <= delta <= 1.0:
        raise ValueError(f"delta {delta} is outside [0, 1]")
    if not lam >= 1.0:
        raise ValueError(f"lambda {lam} must be >= 1")
    if k < 0:
        raise ValueError(f"k {k} must be >= 0")


@dataclass(frozen=True)
class Acceptance:
    kind: str = "exact"
    k: int = 0
    delta: float = 0.0
    lam: float = 1.0
    proximity: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)  # (V, K) int64

    def __post_init__(self):
        check_rule(self.kind, self.k, self.delta, self.lam)
        if self.relaxed:
            if self.proximity is None:
                raise ValueError(f"acceptance {self.kind!r} needs a proximity table (built from the VQ codebook)")
            if self.k > self.proximity.shape[1]:
                raise ValueError(f"k {self.k} exceeds the proximity table's {self.proximity.shape[1]} neighbours")

    @property
    def relaxed(self) -> bool:
        if self.kind == "lantern":
            return self.k > 0 and self.delta > 0
        if self.kind == "lantern++":
            return self.k > 0 and self.lam > 1
        return False

    def boost(self, p: torch.Tensor, x: int) -> tuple[float, float]:
        """(p~(x), moved mass C_m*) for token x under distribution p (V,)."""
        px = float(p[x])
        if not self.relaxed:
            return px, 0.0
        cum = p[self.proximity[x, : self.k]].double().cumsum(0)  # (k,) C_1..C_k, non-decreasing
        bound = self.delta if self.kind == "lantern" else (self.lam - 1.0) * px
        m = int((cum <= bound).sum())  # the qualifying m form a prefix, so m* is their count
        moved = float(cum[m - 1]) if m else 0.0
        return px + moved, moved


@dataclass
class WalkResult:
    path: list[int]  # node ids from the root, root included
    bonus: int  # the token sampled after the last accepted node
    moved: list[float]  # mass moved for each accepted draft token
    reached: list[int]  # depths at which children were tried (for per-depth acceptance rates)


def _second_best(p: torch.Tensor, x: int) -> float:
    top = torch.topk(p, 2).indices.tolist()
    return float(p[top[1]] if top[0] == x else p[top[0]])


def walk_tree(p_nodes: torch.Tensor, children: Sequence[Sequence[int]], tokens: torch.Tensor, valid: torch.Tensor,
              q_nodes: Optional[torch.Tensor], rule: Acceptance, greedy: bool, generator: torch.Generator,
              max_accept: int) -> WalkResult:
    """p_nodes (N, V): target distribution after each node; q_nodes (N, V): the draft distribution each
    node's children were sampled from, or None for deterministic (top-k) drafts, where q_i is a point mass.
    Children are tried in rank order; at most `max_accept` draft tokens are accepted."""
    node, path, moved, reached = 0, [0], [], []
    tok = tokens.tolist()
    while True:
        p = p_nodes[node]
        kids = [c for c in children[node] if valid[c]]
        if len(path) - 1 >= max_accept or not kids:
            return WalkResult(path, _pick(p, greedy, generator), moved, reached)
        reached.append(len(path))
        chosen = (_choose_greedy if greedy else _choose_sampling)(
            p, kids, tok, None if q_nodes is None else q_nodes[node], rule, generator)
        child, residual, mv = chosen
        if child is None:
            return WalkResult(path, _pick(residual, greedy, generator), moved, reached)
        path.append(child)
        moved.append(mv)
        node = child


def _pick(p: torch.Tensor, greedy: bool, generator: torch.Generator) -> int:
    if greedy:
        return int(torch.argmax(p))
    return int(torch.multinomial(p, 1, generator=generator))


def _choose_greedy(p, kids, tok, q, rule: Acceptance, generator):
    best = int(torch.argmax(p))
    for c in kids:
        x = tok[c]
        if not rule.relaxed:
            if x == best:
                return c, p, 0.0
            continue
        p_tilde, mv = rule.boost(p, x)
        if p_tilde >= _second_best(p, x):
            return c, p, mv
    return None, p, 0.0


def _choose_sampling(p, kids, tok, q, rule: Acceptance, generator):
    residual = p.clone()
    remaining = None if q is None else q.clone()
    for c in kids:
        x = tok[c]
        if remaining is None:
            q_i = torch.zeros_like(p)
            q_i[x] = 1.0  # a deterministic draft: x was "drawn" with certainty
        else:
            q_i = remaining / remaining.sum()  # what x was drawn from: q without the earlier candidates
        p_tilde, mv = rule.boost(residual, x)
        # accept with prob min(1, p~(x) / q_i(x))
        if float(torch.rand((), generator=generator)) * float(q_i[x]) < p_tilde:
            return c, residual, mv
        nxt = (residual - q_i).clamp_min(0.0)
        total = float(nxt.sum())
        if total > 0:  # zero only if p <= q_i everywhere, when rejection had probability 0
            residual = nxt / total
        if remaining is not None:
            remaining[x] = 0.0
    return None, residual, 0.0
