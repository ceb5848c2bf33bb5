"""FusedStep (lantern.engine.fused) calls only what the FusedSteps protocol declares, and writes nothing of its
runner's: the warm-up its first steps spend is handed to the runner, which counts it."""
from types import SimpleNamespace

import torch

from lantern.backends.base import FusedSteps
from lantern.engine import fused


class SealedRunner(FusedSteps):
    """A LABELLED FAKE runner that implements FusedSteps and nothing else, and refuses every attribute write from
    outside once built (a write would be FusedStep reaching into it)."""

    def __init__(self):
        object.__setattr__(self, "calls", [])
        object.__setattr__(self, "view", SimpleNamespace(attend=lambda slots: self.calls.append(("attend", slots))))

    def __setattr__(self, name, value):
        raise AttributeError(f"FusedStep wrote runner.{name}")

    def inside(self):
        return self.view

    def fused_warm(self, decode) -> bool:
        return False

    def mark_fused_warm(self, decode) -> None:
        self.calls.append(("warm", decode))

    def take_attended(self) -> int:
        return 7

    def add_fused_warmup(self, seconds: float) -> None:
        self.calls.append(("warm-up", seconds))

    def sync(self) -> None:  # the Runner contract's, which every FusedSteps runner also keeps
        pass


def test_the_fused_step_uses_the_declared_protocol_and_hands_its_warm_up_to_the_runner(monkeypatch):
    monkeypatch.setattr(fused, "decode_step", lambda runner, proposer, slots: torch.zeros(1))  # the step's maths apart
    runner = SealedRunner()
    slots = SimpleNamespace(root=torch.zeros(2), root_tok=torch.zeros(2, dtype=torch.long),
                            emitted=torch.zeros(2, dtype=torch.long))
    step = fused.FusedStep(runner, SimpleNamespace(dcfg="its decode config", state=()), slots)
    for _ in range(fused.WARM_CALLS):
        step()
    assert runner.calls.count(("attend", 7)) == fused.WARM_CALLS  # the bound it took, handed to the traced view
    warm_ups = [c for c in runner.calls if c[0] == "warm-up"]
    assert len(warm_ups) == fused.WARM_CALLS - 1 and all(s >= 0 for _, s in warm_ups)  # every replay until warm
    assert runner.calls[-1] == ("warm", "its decode config")
