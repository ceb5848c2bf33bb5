"""What a decode step and a generation cost: the one model under `--method auto` (lantern.plan.choose, from each
plan's measured step) and `lantern profile tune` (lantern.profile.tune, from step curves over the width). A wider
step never costs less (`dearest_no_wider`); between measured widths (verify N, drafting W, batch) a cost is linear
(`interpolate`); a static tree's step is its verify, its drafting and the host's work (`CostModel`); a request's
seconds are per chunk a fixed cost plus its slowest image's steps (`predict_seconds`).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterable, Sequence

from lantern.decoding.trees import Paths
from lantern.plan.acceptance_records import expected_max


def bracket(xs: Sequence[float], x: float) -> tuple[int, int]:
    """The indices of the two sorted xs (two or more) around x, or of the two nearest ends when x lies past them."""
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    return i - 1, i


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points, extended linearly past both ends, never below 0."""
    if len(points) == 1:
        return points[0][1]
    lo, hi = bracket([p[0] for p in points], x)
    (x0, y0), (x1, y1) = points[lo], points[hi]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


def dearest_no_wider(points: Iterable[tuple[float, float]], width: float) -> float:
    """The highest cost among (width, cost) points no wider than `width` (0 when none is): the least a step
    `width` wide costs, as a wider step never costs less (noise that says otherwise would be chased)."""
    return max((cost for w, cost in points if w <= width), default=0.0)


@dataclass(frozen=True)
class CostModel:
    verify: tuple[tuple[float, float], ...]  # (N, seconds), non-decreasing
    draft: tuple[tuple[float, float], ...]  # (W, seconds), non-decreasing
    host_a: float = 0.0  # seconds per step
    host_b: float = 0.0  # seconds per node per step

    @classmethod
    def from_curves(cls, verify: dict, draft: dict, host_a: float = 0.0, host_b: float = 0.0) -> "CostModel":
        if not verify or not draft:
            raise ValueError("tuning needs a measured verify curve and drafter curve (run `lantern profile run`)")
        return cls(*(tuple((float(x), dearest_no_wider(curve.items(), x)) for x in sorted(curve))
                     for curve in (verify, draft)), host_a, host_b)

    @property
    def max_nodes(self) -> int:
        return int(self.verify[-1][0])

    def step_seconds(self, n: int, depth: int, width: int) -> float:
        drafting = interpolate(self.draft, depth + 1) + (depth - 1) * interpolate(self.draft, max(width, 1))
        return interpolate(self.verify, n) + drafting + self.host_a + self.host_b * n


def tree_shape(paths: Paths) -> tuple[int, int, int]:
    """(N with the root, depth, widest drafting level: nodes with children at one depth >= 1)."""
    parents = {p[:-1] for p in paths if len(p) > 1}
    levels: dict[int, int] = {}
    for p in parents:
        levels[len(p)] = levels.get(len(p), 0) + 1
    return len(paths) + 1, max(len(p) for p in paths), max(levels.values(), default=0)


def fit_host_overhead(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares residual = a + b * N over (N, residual seconds per step); b >= 0, a >= 0."""
    if not points:
        return 0.0, 0.0
    ns = {n for n, _ in points}
    mean_r = sum(r for _, r in points) / len(points)
    if len(ns) < 2:
        return max(mean_r, 0.0), 0.0
    mean_n = sum(n for n, _ in points) / len(points)
    sxx = sum((n - mean_n) ** 2 for n, _ in points)
    b = sum((n - mean_n) * (r - mean_r) for n, r in points) / sxx
    if b < 0:
        return max(mean_r, 0.0), 0.0
    return max(mean_r - b * mean_n, 0.0), b


def predict_seconds(width: int, fixed_s: float, step_s: float, images: list[list[float]]) -> float:
    """images: each requested image's steps (equally likely values), in request order: chunks of `width`."""
    return sum(fixed_s + expected_max(images[i:i + width]) * step_s for i in range(0, len(images), width))
