"""Graph modes for the torch backends: every static step captured once, then only replayed.

`CapturedRunner` is what all graph modes share (cpu-graph and cuda-graph here, hpu in hpu.py):
- it refuses a step width outside the StaticSpec, since that would capture a new graph mid-generation;
- its warm-up runs every step twice, so what a mode does on first and second calls (compile, capture, CUDA
  graph recording) is done before timing starts;
- `graph_keys()` names the graphs a whole generation uses: one per static step (commits included).
Subclasses say only how a step module is captured (`wrap_step`) and what ends a step (`step_done`).

Dynamo keeps at most `recompile_limit` graphs per code object in a process (8 by default), and the step modules
of every runner share their code objects; a compiled runner raises that limit only while its warm-up compiles,
and restores it after, so preparing runners changes nothing for other compiled code in the process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from abc import abstractmethod
from typing import Callable, Optional, Union

import torch
import torch._dynamo

from lantern.backends.base import Runner, StaticSpec, StepOutput, run_every_static_step
from lantern.backends.torch_eager import CPUBackend, CUDABackend, TorchRunner

# Graphs of several runners (other shapes) share the step modules' code objects; a few runners in one process
# would exceed dynamo's default limit of 8 and fail under fullgraph.
MIN_RECOMPILE_LIMIT = 64


def check_width(step: str, width: int, widths: tuple[int, ...]) -> None:
    if width not in widths:
        raise ValueError(f"{step} width {width} is not one of this runner's static widths {widths}: graph mode "
                         f"would capture a new graph mid-generation; add it to StaticSpec.{step}_widths")


@contextlib.contextmanager
def recompile_limit_at_least(limit: int):
    """Dynamo's process-wide recompile limit raised to `limit` inside the block only."""
    config = torch._dynamo.config
    old = config.cache_size_limit  # torch 2.4's name; newer torch keeps it as an alias of recompile_limit
    config.cache_size_limit = max(old, limit)
    try:
        yield
    finally:
        config.cache_size_limit = old


def as_inference(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The step inputs as inference tensors. Dynamo guards on dispatch keys, and a tensor made outside
    inference mode carries keys an inference tensor lacks: mixing both would key two graphs of one shape."""
    with torch.inference_mode():
        return tuple(t if t.is_inference() else t.clone() for t in tensors)


class CapturedRunner(TorchRunner):
    """TorchRunner whose step modules are captured graphs; the eager reference stays untouched."""

    trims_attention = False  # every step keeps its one static shape

    clone_outputs = False  # True where a replay returns the same output buffers every time
    capture_kind = ""  # how steps are captured, for the profile record

    @abstractmethod
    def wrap_step(self, name: str, module: torch.nn.Module) -> Callable:
        """The step module as a captured, replayable callable."""

    def step_done(self) -> None:
        """(optional) What must follow every step (lazy HPU: mark_step); default nothing."""

    def graph_keys(self) -> list[str]:
        return self.spec.static_steps

    def _finish(self, out: StepOutput) -> StepOutput:
        if self.clone_outputs:
            out = StepOutput(out.logits.clone(), out.hidden.clone())
        self.step_done()
        return out

    def prefill(self, cond, mask):
        return self._finish(super().prefill(*as_inference(cond, mask)))

    def verify(self, tokens, positions, slots, mask):
        check_width("verify", tokens.shape[1], self.spec.verify_widths)
        return self._finish(super().verify(*as_inference(tokens, positions, slots, mask)))

    def draft(self, tokens, features, positions, slots, mask):
        if self.drafter is not None:
            check_width("draft", tokens.shape[1], self.spec.draft_widths)
        return self._finish(super().draft(*as_inference(tokens, features, positions, slots, mask)))

    def commit(self, src, dst):
        super().commit(*as_inference(src, dst))
        self.step_done()

    def warmup(self) -> float:
        """Every static step twice: compiled or captured on the first pass, recorded or replayed on the second.
        The time is reported apart from generation."""
        t0 = time.perf_counter()
        run_every_static_step(self)
        run_every_static_step(self)
        self.sync()
        self.warmup_seconds = time.perf_counter() - t0
        return self.warmup_seconds

    def profile(self) -> dict:
        return {**super().profile(), "capture": self.capture_kind, "graphs": self.graph_keys()}


class CompiledRunner(CapturedRunner):
    """Each step module through torch.compile(fullgraph=True, dynamic=False): one graph per static shape."""

    def __init__(self, target, drafter, spec: StaticSpec, device: torch.device,
                 compiler: Union[str, Callable] = "inductor", mode: Optional[str] = None):
        self.compiler, self.mode = compiler, mode
        self.capture_kind = f"torch.compile(backend={getattr(compiler, '__name__', compiler)!s}, mode={mode})"
        # reduce-overhead (CUDA graphs) replays into the same output buffers, so the next replay overwrites them
        self.clone_outputs = mode == "reduce-overhead"
        super().__init__(target, drafter, spec, device)

    def wrap_step(self, name, module):
        options = {"mode": self.mode} if self.mode else {}
        return torch.compile(module, backend=self.compiler, fullgraph=True, dynamic=False, **options)

    def warmup(self) -> float:
        """Every step compiled here (graph modes never compile after warm-up), under a raised recompile limit."""
        with recompile_limit_at_least(MIN_RECOMPILE_LIMIT):
            return super().warmup()


class CPUGraphBackend(CPUBackend):
    """cpu-graph: the CPU steps compiled once per static shape (inductor by default)."""

    name = "cpu-graph"

    def __init__(self, threads: int | None = None, compiler: Union[str, Callable] = "inductor"):
        super().__init__(threads)
        self.compiler = compiler

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), supports_graphs=True)

    def prepare(self, target, drafter, spec: StaticSpec) -> Runner:
        self.check_dtype(spec.dtype)
        device = torch.device("cpu")
        runner = CompiledRunner(*self.placed(target, drafter if spec.draft_widths else None, device, spec.dtype),
                                spec, device, compiler=self.compiler)
        runner.backend_name = self.name
        runner.threads = self.threads
        return runner


class CUDAGraphBackend(CUDABackend):
    """cuda-graph: inductor with mode="reduce-overhead", i.e. each static step replayed as a CUDA graph."""

    name = "cuda-graph"

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), supports_graphs=True)

    def prepare(self, target, drafter, spec: StaticSpec) -> Runner:
        self.check_dtype(spec.dtype)
        device = torch.device("cuda", self.device_index)
        runner = CompiledRunner(*self.placed(target, drafter if spec.draft_widths else None, device, spec.dtype),
                                spec, device, compiler="inductor", mode="reduce-overhead")
        runner.backend_name = self.name
        return runner
