"""The cost model (lantern.plan.cost_model) `--method auto` predicts with."""
import pytest

from lantern.plan import calibration
from lantern.plan.cost_model import dearest_no_wider, interpolate


def test_costs_are_linear_between_measured_widths_extended_past_the_ends_and_never_negative():
    points = [(1.0, 1.0), (4.0, 4.0), (8.0, 6.0)]
    assert interpolate(points, 2.0) == pytest.approx(2.0)
    assert interpolate(points, 6.0) == pytest.approx(5.0)
    assert interpolate(points, 10.0) == pytest.approx(7.0)  # the last two points' slope, extended
    assert interpolate([(2.0, 1.0), (4.0, 3.0)], 0.0) == 0.0  # extended below zero: clamped
    assert interpolate([(3.0, 5.0)], 100.0) == 5.0  # one point: a constant


def test_a_wider_step_never_costs_less():
    assert dearest_no_wider([(1, 2.0), (4, 1.0), (8, 3.0)], 6) == 2.0
    assert dearest_no_wider([(4, 1.0)], 2) == 0.0  # nothing narrower measured: no floor


def test_auto_reads_unmeasured_batch_widths_linearly_between_the_measured_ones():
    fixed = {1: 1.0, 4: 2.5, 8: 2.0}
    widths = {str(w): {"fixed_s": f, "plans": {"ar": {"step_s": f / 10}}} for w, f in fixed.items()}
    for width in (2, 6, 12):
        expected = interpolate(sorted(fixed.items()), width)
        entry = calibration.at_width(widths, width)
        assert entry["fixed_s"] == pytest.approx(expected)
        assert entry["plans"]["ar"]["step_s"] == pytest.approx(expected / 10)
