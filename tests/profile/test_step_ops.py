"""The eager step's aten ops, counted as dispatched (tests/step_ops.py): on a GPU nearly each is a kernel launch,
so what a step dispatches beyond the target's forward may not grow past its method's budget (step_op_budgets.json,
the embedded bundle at its own sampling; tools/bench_step_ops.py writes the whole table)."""
import json
from pathlib import Path

import pytest
import torch

from lantern.api import Pipeline
from lantern.backends.base import dummy_step_inputs
from lantern.bundle import load_bundle
from lantern.decoding import SamplingConfig, method_preset
from lantern.decoding.config import METHODS
from step_ops import OpCounter, step_ops

BUDGETS = json.loads(Path(__file__).with_name("step_op_budgets.json").read_text())


@pytest.fixture(scope="module")
def embedded():
    bundle = load_bundle()
    sampling = SamplingConfig(**bundle.default_sampling)
    pipe = Pipeline(bundle.target, bundle.drafter, bundle.proximity, backend="cpu", dtype=BUDGETS["dtype"])
    return pipe, {m: method_preset(m, sampling, **bundle.relaxation_at(sampling).get(m, {})) for m in METHODS}


def test_the_counter_counts_every_op_in_its_region_and_tells_views_from_launches():
    x = torch.ones(3)
    with OpCounter() as ops:
        y = x + 1
        with ops.region("draws"):
            z = (y * 2).view(3, 1)  # a product, then a view of it
            y.add_(z[:, 0])  # a select (a view), then an in-place add (it returns its input, but writes: a launch)
    assert ops.counts == {"rest": 1, "draws": 4} and ops.views == {"draws": 2}


def test_every_method_has_a_budget():
    assert set(BUDGETS["beyond_forward"]) == set(METHODS)


@pytest.mark.parametrize("method", METHODS)
def test_a_steps_ops_beyond_its_forward_stay_within_the_methods_budget(embedded, method):
    pipe, decodes = embedded
    first, second = step_ops(pipe, decodes[method], steps=2)
    pipe.release()
    assert first == second  # a static shape: every steady step dispatches the same ops
    assert first.beyond <= BUDGETS["beyond_forward"][method], first.to_dict()


def test_the_forward_is_the_ops_of_the_runners_verify_alone(embedded):
    pipe, decodes = embedded
    (counted,) = step_ops(pipe, decodes["ar"], steps=1)
    runner = pipe.runner(decodes["ar"], 1)
    inputs = dummy_step_inputs(runner.spec, 1, runner.device)
    with torch.inference_mode(), OpCounter() as alone:
        runner.verify(*inputs)
    pipe.release()
    assert counted.forward == alone.counts["rest"] > 0


def test_counting_refuses_steps_that_would_finish_the_image(embedded):
    pipe, decodes = embedded
    with pytest.raises(ValueError, match="steps 0 must be >= 1"):
        step_ops(pipe, decodes["ar"], steps=0)
    with pytest.raises(ValueError, match="may finish the 256-token image"):
        step_ops(pipe, decodes["mc-sjd"], steps=100)
