"""The engine's whole decode step as one graph, on graph backends that offer it (`fused_step=True`): the proposer
and the step run against the runner's `inside()` view (its eager step modules traced into the one graph, phases
not timed), and every piece of state the step replaces lives in persistent buffers that `FusedStep` keeps, copying
a refill's new values in before the next step, so a recorded graph replays over the same memory. The first step
runs eagerly through the same view. docs/engine.md, "Fused step", describes the design.
"""
from __future__ import annotations

import time

import torch

from lantern.backends.torch_graph import CUDAGraphReplay
from lantern.engine.step import decode_step

SLOT_STATE = ("root", "root_tok", "emitted")  # what decode_step replaces on the slots
# a configuration's fused warm-up on a runner: one eager step, the replayer's warm calls (compile, then two that
# must not recompile), the capture and its replay
WARM_CALLS = 1 + CUDAGraphReplay.WARM_CALLS + 1


def fused_decode_step(runner, proposer, slots, places) -> torch.Tensor:
    """decode_step, with the state it replaces written back into the buffers it found (places: (object,
    attribute) pairs). The function every graph mode captures."""
    buffers = [getattr(obj, name) for obj, name in places]
    report = decode_step(runner, proposer, slots)
    for (obj, name), buffer in zip(places, buffers):
        _write(buffer, getattr(obj, name))
        setattr(obj, name, buffer)
    return report


def _write(buffer, value) -> None:
    """value (a tensor, or a tuple of them like Support) into buffer of the same structure, in place."""
    if isinstance(buffer, torch.Tensor):
        buffer.copy_(value)
        return
    for b, v in zip(buffer, value):
        _write(b, v)


def _same(value, buffer) -> bool:
    """Whether value holds exactly the buffer's tensors (a traced step may hand back a new tuple of them)."""
    if isinstance(buffer, torch.Tensor):
        return value is buffer
    return all(_same(v, b) for v, b in zip(value, buffer))


def _own(value):
    """A dense copy of value (tensor or tuple of tensors): buffers are written in place, so never a view."""
    if isinstance(value, torch.Tensor):
        return value.clone(memory_format=torch.contiguous_format)
    return type(value)(*(_own(v) for v in value))


class FusedStep:
    """One engine's step as its runner captures it. runner: the runner's FusedSteps (Runner.fused_steps());
    proposer: built on `runner.inside()`; slots: the engine's."""

    def __init__(self, runner, proposer, slots):
        self.runner, self.decode = runner, proposer.dcfg
        self.places = tuple((slots, name) for name in SLOT_STATE) + tuple((proposer, n) for n in proposer.state)
        self.args = (runner.inside(), proposer, slots, self.places)
        compiled = runner.capture_step(fused_decode_step)
        self._replay = runner.replayable(lambda: compiled(*self.args))
        self._buffers = None
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        """Every running slot moves on by one step; returns decode_step's report."""
        self._pin()
        self.runner.inside().attend(self.runner.take_attended())
        if self.calls == 0:
            report = fused_decode_step(*self.args)  # eager: first-use caches are built outside any graph
        else:
            t0 = time.perf_counter()
            report = self._replay()
            if not self.runner.fused_warm(self.decode) and self.calls < WARM_CALLS:
                self.runner.sync()
                self.runner.add_fused_warmup(time.perf_counter() - t0)
        self.calls += 1
        if self.calls == WARM_CALLS:
            self.runner.mark_fused_warm(self.decode)
        return report

    def _pin(self) -> None:
        """Put the persistent buffers back where the eager prefill replaced them, with the prefill's values."""
        if self._buffers is None:
            self._buffers = [_own(getattr(obj, name)) for obj, name in self.places]
        for (obj, name), buffer in zip(self.places, self._buffers):
            value = getattr(obj, name)
            if not _same(value, buffer):
                _write(buffer, value)
                setattr(obj, name, buffer)
