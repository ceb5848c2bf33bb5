"""Aten ops per decode step, counted as they are dispatched (a TorchDispatchMode: any device, the CPU included), by
where in the step they run. A test instrument, not part of lantern (tests/profile/test_step_ops.py holds each method's
step to a budget with it, and tools/bench_step_ops.py writes the whole table).

On a GPU an eager step launches a kernel for nearly every op it dispatches (views aside), a few microseconds each
however small the tensor, so what a step dispatches beyond the target's forward is its overhead: what a CUDA graph or
a fused step saves, and what eager pays on every step. Regions (the innermost one an op runs in counts it):
- forward: the target's forward (Runner.verify);
- drafter: the drafter's forwards (Runner.draft);
- draws: the counter hash of the random streams (lantern.engine.draws.SlotDraws: a step's keys, every draw, and MC-SJD's
  keyed noise);
- proposal: the draft phase beyond the drafter's forwards (candidates, trees, masks);
- distributions: the verify phase beyond the forward (CFG, temperature, top-k of the verify logits);
- acceptance: the accept phase beyond its draws;
- commit: the commit phase (the target's cache compaction);
- rest: the step outside any phase (AR's and Jacobi's proposals and redraws, the emit, the step's counts, the
  engine's one read per step).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lantern.engine import Engine, Request
from lantern.models.family import neutral_conditions

FORWARD = "forward"
PHASE_REGIONS = {"draft": "proposal", "verify": "distributions", "accept": "acceptance", "commit": "commit"}
REGIONS = (FORWARD, "drafter", "draws", *PHASE_REGIONS.values(), "rest")


class OpCounter(TorchDispatchMode):
    """with OpCounter() as ops: ...; ops.counts[region] is the aten ops dispatched inside, by region (`region`
    names the one the code inside it runs in; "rest" outside every region), and ops.views[region] those of them that
    only returned an input or a view of one (a launch of nothing)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.views: Counter = Counter()
        self._regions = ["rest"]

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        self._regions.append(name)
        try:
            yield
        finally:
            self._regions.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        region = self._regions[-1]
        self.counts[region] += 1
        if not func._schema.is_mutable and _storages(out) <= _storages([*args, *kwargs.values()]):
            self.views[region] += 1
        return out


def _storages(values) -> set:
    """The storages (by address) of the tensors in values (a tensor, or nested tuples and lists of them)."""
    if isinstance(values, torch.Tensor):
        return {values.untyped_storage().data_ptr()}
    if isinstance(values, (tuple, list)):
        return set().union(*(_storages(v) for v in values))
    return set()


@dataclass(frozen=True)
class StepOps:
    """One decode step's aten ops by region (REGIONS), and how many of them only returned a view."""

    regions: dict
    views: dict

    @property
    def forward(self) -> int:
        return self.regions[FORWARD]

    @property
    def beyond(self) -> int:
        """Everything the step dispatches beyond the target's forward."""
        return self.total - self.forward

    @property
    def total(self) -> int:
        return sum(self.regions.values())

    @property
    def beyond_views(self) -> int:
        return sum(self.views.values()) - self.views[FORWARD]

    def to_dict(self) -> dict:
        return {"total": self.total, "forward": self.forward, "beyond_forward": self.beyond,
                "beyond_forward_views": self.beyond_views, "regions": self.regions, "views": self.views}


def _wrapped(obj, name: str, wrap) -> contextlib.AbstractContextManager:
    """obj.name replaced (on the instance) by wrap(original) inside the block; restored after."""
    @contextlib.contextmanager
    def patched():
        own = obj.__dict__.get(name)
        setattr(obj, name, wrap(getattr(obj, name)))
        try:
            yield
        finally:
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
    return patched()


@contextlib.contextmanager
def counting_regions(counter: OpCounter, engine: Engine) -> Iterator[None]:
    """The engine's runner and random streams report their regions to `counter` inside the block."""
    runner, draws = engine.runner, engine.slots.draws

    def within(region):
        def wrap(call):
            def counted(*args, **kwargs):
                with counter.region(region):
                    return call(*args, **kwargs)
            return counted
        return wrap

    def phases(phase):
        @contextlib.contextmanager
        def counted(name):
            with phase(name), counter.region(PHASE_REGIONS.get(name, name)):
                yield
        return counted
    with contextlib.ExitStack() as stack:
        stack.enter_context(_wrapped(runner, "verify", within(FORWARD)))
        stack.enter_context(_wrapped(runner, "draft", within("drafter")))
        stack.enter_context(_wrapped(runner, "phase", phases))
        for method in ("begin", "uniform", "keyed_uniform"):
            stack.enter_context(_wrapped(draws, method, within("draws")))
        yield


def step_ops(pipeline, decode, steps: int = 2, seed: int = 0) -> list[StepOps]:
    """The aten ops of `steps` decode steps of one image (a neutral condition) on a one-slot engine of `pipeline`,
    after its first step (which prefills). The eager step: a pipeline on a backend without a fused step."""
    if steps < 1:
        raise ValueError(f"steps {steps!r} must be >= 1")
    engine = Engine(pipeline, decode, 1)
    block = pipeline.config.block_size
    if (steps + 1) * (engine.proposer.depth + 1) + 1 > block:
        raise ValueError(f"{steps} steps may finish the {block}-token image before they are counted; allowed: at most "
                         f"{(block - 1) // (engine.proposer.depth + 1) - 1} at depth {engine.proposer.depth}")
    request = engine.submit(Request(neutral_conditions(pipeline.config, 1)[0], seed=seed))
    engine.step()  # the prefill, then a first step
    out = []
    for _ in range(steps):
        with OpCounter() as counter, counting_regions(counter, engine):
            engine.step()
        out.append(StepOps(*({name: count[name] for name in REGIONS} for count in (counter.counts, counter.views))))
    engine.cancel(request)
    engine.run()  # one step frees the slot: the runner is free for the next engine
    return out
