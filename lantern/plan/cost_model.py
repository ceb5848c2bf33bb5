"""What a generation costs under `--method auto` (lantern.plan.choose, from each plan's measured step). A wider
step never costs less (`dearest_no_wider`); between measured batch widths a cost is linear (`interpolate`); a
request's seconds are per chunk a fixed cost plus its slowest image's steps (`predict_seconds`).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Iterable, Sequence

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


def predict_seconds(width: int, fixed_s: float, step_s: float, images: list[list[float]]) -> float:
    """images: each requested image's steps (equally likely values), in request order: chunks of `width`."""
    return sum(fixed_s + expected_max(images[i:i + width]) * step_s for i in range(0, len(images), width))
