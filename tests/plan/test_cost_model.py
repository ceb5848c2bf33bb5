"""The one cost model (lantern.plan.cost_model) that `--method auto` and `lantern profile tune` both read."""
import pytest

from lantern.plan import calibration
from lantern.plan.cost_model import CostModel, dearest_no_wider, interpolate, tree_shape


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
    model = CostModel.from_curves({1: 2e-3, 4: 1e-3, 8: 3e-3}, {1: 1e-3, 2: 0.5e-3})
    assert model.verify == ((1.0, 2e-3), (4.0, 2e-3), (8.0, 3e-3)) and model.draft == ((1.0, 1e-3), (2.0, 1e-3))


def test_a_tree_step_is_its_verify_its_drafting_and_the_host_work():
    paths = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))  # N 6, depth 3, two nodes with children at depth 1
    assert tree_shape(paths) == (6, 3, 2)
    model = CostModel.from_curves({2: 2.0, 10: 10.0}, {1: 1.0, 5: 5.0}, host_a=0.5, host_b=0.25)
    # verify(6) + draft(depth + 1) + (depth - 1) * draft(widest level) + host_a + host_b * N
    assert model.step_seconds(*tree_shape(paths)) == pytest.approx(6.0 + 4.0 + 2 * 2.0 + 0.5 + 0.25 * 6)


def test_auto_reads_unmeasured_batch_widths_by_the_same_interpolation_as_tune_reads_tree_widths():
    fixed = {1: 1.0, 4: 2.5, 8: 2.0}
    widths = {str(w): {"fixed_s": f, "plans": {"ar": {"step_s": f / 10}}} for w, f in fixed.items()}
    for width in (2, 6, 12):
        expected = interpolate(sorted(fixed.items()), width)
        entry = calibration.at_width(widths, width)
        assert entry["fixed_s"] == pytest.approx(expected)
        assert entry["plans"]["ar"]["step_s"] == pytest.approx(expected / 10)
