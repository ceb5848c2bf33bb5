"""The engine's host (lantern.engine.host): a request's condition is checked once, when it is submitted, not again
when it takes a slot; run_batch takes conditions its host checked already without checking them again."""
import pytest

import lantern.api
from lantern.api import Pipeline, check_classes
from lantern.decoding import SamplingConfig, method_preset
from lantern.engine import Engine, Request, run_batch

AR = method_preset("ar", SamplingConfig())


@pytest.fixture
def class_checks(monkeypatch) -> list:
    """The class ids each call of check_classes was given."""
    calls = []

    def counted(ids, num_classes):
        calls.append(list(ids))
        return check_classes(ids, num_classes)
    monkeypatch.setattr(lantern.api, "check_classes", counted)
    return calls


def test_a_requests_condition_is_checked_at_submit_alone(tiny, class_checks):
    engine = Engine(Pipeline(*tiny, backend="cpu"), AR, 2)
    for i in range(3):  # the third waits for a slot, then takes one at a refill
        engine.submit(Request(i, seed=i, tokens=2))
    assert len(engine.run()) == 3
    assert class_checks == [[0], [1], [2]]


def test_run_batch_checks_raw_conditions_once_and_checked_ones_not_again(tiny, class_checks):
    pipe = Pipeline(*tiny, backend="cpu")
    raw = run_batch(pipe, AR, 2, [1, 2, 1], tokens=2)
    assert class_checks == [[1, 2, 1]]
    checked = pipe.conditions([1, 2, 1])
    again = run_batch(pipe, AR, 2, checked, tokens=2)
    assert class_checks == [[1, 2, 1]] * 2  # pipe.conditions' own check, and none in run_batch
    assert [r.tokens.tolist() for r in again.results] == [r.tokens.tolist() for r in raw.results]
