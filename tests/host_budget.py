"""What crosses to the host per engine step: the structural budget test_speculative and test_jacobi check."""
import torch

import lantern.engine.proposers as proposers
from lantern.engine import Engine, Request
from host_transfers import counted_steps, per_step


def check_host_budget(pipe, dcfg, phase: str, monkeypatch) -> None:
    """Between two acceptance phases (one whole step, refills included) at most 2 host transfers: the step's
    report and finished flags (O(B * depth) elements), and on a step where images finish, their tokens and
    records once. 5 requests through 3 slots."""
    b = 3
    engine = Engine(pipe, dcfg, b)
    monkeypatch.setattr(engine.runner, "trims_attention", False)
    for c in (0, 1, 2, 1, 0):
        engine.submit(Request(c, seed=c))
    finished = []
    with counted_steps(proposers, phase) as marks:
        while engine.waiting or engine.busy:
            finished.append(len(engine.step().finished))
    calls, elements = per_step(marks)
    s = engine.slots
    row = 1 + s.out.shape[1] + s.records.packed(torch.tensor([0])).shape[1]  # one finished image
    assert len(marks) > 3 and max(calls) <= 2
    budget = 2 * b * (engine.proposer.depth + 1)
    assert all(e <= budget + n * row for e, n in zip(elements, finished))
    assert sum(finished) == 5
