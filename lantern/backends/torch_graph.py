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

from lantern.backends.base import (FusedSteps, Runner, StaticSpec, StepOutput, run_every_static_step,
                                   run_prefill)
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
    import torch._dynamo  # here, not at the top: importing dynamo costs seconds that eager-only commands skip
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


def dynamic_length(t: torch.Tensor) -> torch.Tensor:
    """t, its last dimension marked dynamic for torch.compile: a step compiled once reads any number of cache
    slots (cpu-graph's bounded attention) instead of one graph per length."""
    import torch._dynamo  # here, not at the top: importing dynamo costs seconds
    torch._dynamo.mark_dynamic(t, t.dim() - 1)
    return t


def fusable(spec: Optional[StaticSpec], target) -> Optional[str]:
    """Why the engine's step cannot run as one graph on a runner of this shape and target (None: it can)."""
    if target.config.model_type == "t2i":
        return ("text-to-image: the caption mask is rebuilt on the host at each refill (lantern.engine.caption_mask), "
                "so its steps keep one graph per static step")
    if getattr(target, "prefix_visible", None) is not None:
        return ("padded prompt rows (Chameleon's unconditional row): the engine hides the padding in a runner "
                "wrapper (lantern.engine.caption_mask) that one fused graph would bypass, so its steps keep one graph "
                "per static step")
    return None


class StepInside:
    """A captured runner as the fused step sees it from inside its one graph: the same spec, device and decode
    steps (verify, draft, commit), but each is the runner's eager module (traced into the step's graph, not a
    graph of its own), and phases are not timed (a timer reads the host clock and syncs: it would end the
    graph)."""

    def __init__(self, runner: "CapturedRunner"):
        self.spec, self.device, self.model_config = runner.spec, runner.device, runner.model_config
        self.modules = runner.modules
        self.bounded = runner.bounds_attention
        self._span = torch.empty(self.spec.max_len, dtype=torch.bool, device=self.device)
        self.span = self._span  # its length: the slots the next verify reads (a graph input of dynamic length)

    def attend(self, slots: int) -> None:
        """The next verify reads the first `slots` cache slots (a bounded runner's graph reads the length of
        `span`, one dynamic dimension, so any length replays the same graph)."""
        if self.bounded:
            self.span = dynamic_length(self._span[:slots])

    def phase(self, name: str):
        return contextlib.nullcontext()

    def verify(self, tokens, positions, slots, mask):
        if self.bounded:
            mask = mask[..., :self.span.shape[0]]
        return StepOutput(*self.modules["verify"](tokens, positions, slots, mask))

    def draft(self, tokens, features, positions, slots, mask):
        return StepOutput(*self.modules["draft"](tokens, features, positions, slots, mask))

    def commit(self, src, dst):
        self.modules["commit"](src, dst)


class CapturedRunner(TorchRunner, FusedSteps):
    """TorchRunner whose step modules are captured graphs; the eager reference stays untouched.

    Fused step (optional, `fused=True`): the engine's whole decode step becomes one graph per static step
    (lantern.engine.fused), and `fused_steps()` returns the runner as a FusedSteps: `inside()`, the view the step
    is traced against, and `capture_step(fn)`, the step function compiled once per runner and captured once per
    engine by `replayable`. Prefill stays a per-module graph (it runs at refills, not every step)."""

    trims_attention = False  # the mask never sets a step's shape (bounds_attention: the engine's bound does)

    clone_outputs = False  # True where a replay returns the same output buffers every time
    capture_kind = ""  # how steps are captured, for the profile record
    fused = False  # the engine's step runs as one graph (lantern.engine.fused)
    not_fused: Optional[str] = None  # why a requested fused step is not used

    _attend_end: Optional[int] = None  # the engine's bound for its next step (attend_until)

    def attend_until(self, end: int) -> None:
        if self.bounds_attention:
            self._attend_end = end

    def take_attended(self) -> int:
        """The cache slots the next verify reads, and the engine's bound is used up: the whole cache unless the
        runner bounds attention and an engine gave a bound for this step (at least `attention_floor`, at most
        the cache). A bound holds for one step only, so a later caller (a profile, another engine) never
        inherits it."""
        end, self._attend_end = self._attend_end, None
        return self.spec.max_len if end is None else min(self.spec.max_len, max(end, self.attention_floor))

    def fused_steps(self) -> Optional[FusedSteps]:
        return self if self.fused else None

    def fused_warm(self, decode) -> bool:
        """Whether an engine of this DecodeConfig has compiled (and captured) its fused step on this runner. A
        step's graph depends on the configuration (its acceptance rule, its proposer), not on the runner's shape
        alone: another configuration on the same runner compiles a graph of its own at its first steps."""
        return decode in self.__dict__.get("_fused_warm", ())

    def mark_fused_warm(self, decode) -> None:
        self.__dict__.setdefault("_fused_warm", set()).add(decode)

    def add_fused_warmup(self, seconds: float) -> None:
        self.fused_warmup_seconds += seconds
        self.warmup_seconds += seconds

    def inside(self) -> StepInside:
        """The view the fused step is traced against (one per runner)."""
        if "_inside" not in self.__dict__:
            self._inside = StepInside(self)
        return self._inside

    def replayable(self, call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """One engine's step, called as it is with the runner's threads (torch.compile's graph is replayed by
        calling it)."""
        def step() -> torch.Tensor:
            with self._threads():
                return call()
        return step

    @abstractmethod
    def wrap_step(self, name: str, module: torch.nn.Module) -> Callable:
        """The step module as a captured, replayable callable."""

    def step_done(self) -> None:
        """(optional) What must follow every step (lazy HPU: mark_step); default nothing."""

    def graph_keys(self) -> list[str]:
        """One graph per static step; fused: the prefill's and the whole decode step's."""
        return ["prefill", "step"] if self.fused else self.spec.static_steps

    def _finish(self, out: StepOutput) -> StepOutput:
        if self.clone_outputs:
            out = StepOutput(out.logits.clone(), out.hidden.clone())
        self.step_done()
        return out

    def prefill(self, cond, mask):
        return self._finish(super().prefill(*as_inference(cond, mask)))

    def verify(self, tokens, positions, slots, mask):
        check_width("verify", tokens.shape[1], self.spec.verify_widths)
        end = self.take_attended()
        tokens, positions, slots, mask = as_inference(tokens, positions, slots, mask)
        if self.bounds_attention:
            with torch.inference_mode():
                mask = dynamic_length(mask[..., :end].contiguous())
        return self._finish(super().verify(tokens, positions, slots, mask))

    def draft(self, tokens, features, positions, slots, mask):
        if self.drafter is not None:
            check_width("draft", tokens.shape[1], self.spec.draft_widths)
        return self._finish(super().draft(*as_inference(tokens, features, positions, slots, mask)))

    def commit(self, src, dst):
        super().commit(*as_inference(src, dst))
        self.step_done()

    def warmup(self) -> float:
        """Every static step twice: compiled or captured on the first pass, recorded or replayed on the second.
        The time is reported apart from generation. Fused: the prefill only (the step's own graph needs an
        engine's state; it is compiled at the engine's first steps and its time added here then)."""
        t0 = time.perf_counter()
        for _ in range(2):
            if self.fused:
                run_prefill(self)
            else:
                run_every_static_step(self)
        self.sync()
        self.warmup_seconds = time.perf_counter() - t0
        return self.warmup_seconds

    def profile(self) -> dict:
        step = "fused step" if self.fused else "per-module graphs"
        out = {**super().profile(), "capture": self.capture_kind, "graphs": self.graph_keys(), "step": step,
               "fused_warmup_s": self.fused_warmup_seconds}
        if self.not_fused:
            out["not_fused"] = self.not_fused
        return out


@contextlib.contextmanager
def fail_on_recompile():
    """Inside the block a compiled function that would recompile raises instead (a first compile too)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:  # torch >= 2.6
        with set_stance("fail_on_recompile"):
            yield
        return
    from torch._dynamo import config  # here, not at the top: importing dynamo costs seconds
    old, config.error_on_recompile = config.error_on_recompile, True
    try:
        yield
    finally:
        config.error_on_recompile = old


class CUDAGraphReplay:
    """One engine's fused step recorded once as a CUDA graph, then replayed. The first `WARM_CALLS` calls run the
    compiled step on a side stream (lazy initialisation happens outside any recording): the first compiles, the
    others run under a fail-on-recompile stance, so a guard that would not hold on a later call fails there, on
    the host, instead of recompiling inside the recording (a hard error of torch.cuda.graph). The next call
    records it, under the same stance, and replays the recording (recording alone runs nothing); every later
    call replays. The step reads and writes only the engine's persistent buffers, so a replay is the whole step;
    its report lands in the same tensor every replay (the engine reads it before the next).
    cuda: torch.cuda (a test passes a labelled fake)."""

    WARM_CALLS = 3  # one that compiles, two that must not

    def __init__(self, call: Callable[[], torch.Tensor], cuda=torch.cuda):
        self.call, self.cuda = call, cuda
        self.warm_calls, self.graph, self.report = 0, None, None

    def __call__(self) -> torch.Tensor:
        cuda = self.cuda
        if self.warm_calls < self.WARM_CALLS:
            side = cuda.Stream()
            side.wait_stream(cuda.current_stream())
            stance = fail_on_recompile() if self.warm_calls else contextlib.nullcontext()
            with cuda.stream(side), stance:
                report = self.call()
            cuda.current_stream().wait_stream(side)
            self.warm_calls += 1
            return report
        if self.graph is None:
            self.graph = cuda.CUDAGraph()
            with fail_on_recompile(), cuda.graph(self.graph):
                self.report = self.call()
        self.graph.replay()
        return self.report


class CompiledRunner(CapturedRunner):
    """Each step module through torch.compile(fullgraph=True): one graph per static shape (on a CPU, with the
    attended slots as its one dynamic dimension: `bounds_attention`, dynamic=None so that the marked dimension is
    dynamic from the first compile and every other stays static).
    fused: the engine's whole step compiled the same way instead (one graph; on CUDA compiled without
    reduce-overhead and recorded as one CUDA graph by `CUDAGraphReplay`)."""

    def __init__(self, target, drafter, spec: StaticSpec, device: torch.device,
                 compiler: Union[str, Callable] = "inductor", mode: Optional[str] = None, fused: bool = False):
        self.compiler, self.mode = compiler, mode
        self.bounds_attention = device.type == "cpu"  # inductor's CPU code takes a dynamic length at no cost
        self.fused = fused and fusable(spec, target) is None
        self.not_fused = fusable(spec, target) if fused else None  # why a fused step was not possible
        self.capture_kind = f"torch.compile(backend={getattr(compiler, '__name__', compiler)!s}, mode={mode})"
        self._compiled_steps: dict = {}
        # reduce-overhead (CUDA graphs) replays into the same output buffers, so the next replay overwrites them
        self.clone_outputs = mode == "reduce-overhead"
        super().__init__(target, drafter, spec, device)

    @property
    def _dynamic(self) -> Optional[bool]:
        """torch.compile's `dynamic`: None (static but for marked dimensions) where attention is bounded."""
        return None if self.bounds_attention else False

    def wrap_step(self, name, module):
        options = {"mode": self.mode} if self.mode else {}
        return torch.compile(module, backend=self.compiler, fullgraph=True, dynamic=self._dynamic, **options)

    def warmup(self) -> float:
        """Every step compiled here (graph modes never compile after warm-up), under a raised recompile limit."""
        with recompile_limit_at_least(MIN_RECOMPILE_LIMIT):
            return super().warmup()

    def capture_step(self, fn):
        """fn compiled whole (fullgraph: a graph break is an error), once per runner."""
        if fn not in self._compiled_steps:
            mode = None if self.mode == "reduce-overhead" else self.mode  # CUDA: recorded by CUDAGraphReplay
            options = {"mode": mode} if mode else {}
            compiled = torch.compile(fn, backend=self.compiler, fullgraph=True, dynamic=self._dynamic, **options)

            def step(*args):
                with recompile_limit_at_least(MIN_RECOMPILE_LIMIT):
                    return compiled(*args)
            self._compiled_steps[fn] = step
        return self._compiled_steps[fn]

    def replayable(self, call):
        call = super().replayable(call)
        return CUDAGraphReplay(call) if self.mode == "reduce-overhead" else call


class FusingBackend:
    """What the graph backends of the torch steps share: the fused step, unless the target keeps the engine's step
    apart (`fusable`)."""

    @classmethod
    def fused_step_problem(cls, target) -> Optional[str]:
        return fusable(None, target)


class CompilingBackend(FusingBackend):
    """What the torch.compile backends share: a compile a new process pays again."""

    @classmethod
    def forget_prepared(cls) -> None:
        """Drop what dynamo compiled in this process, as a new process starts without it: the next compile traces
        again and reads the compile caches on disk, paying what a later process pays (how `lantern profile
        calibrate` measures the preparation the prepare ledger keeps)."""
        import torch._dynamo  # here, not at the top: importing dynamo costs seconds
        torch._dynamo.reset()


class CPUGraphBackend(CompilingBackend, CPUBackend):
    """cpu-graph: the CPU steps compiled once per static shape (inductor by default)."""

    name = "cpu-graph"
    abilities = dataclasses.replace(CPUBackend.abilities, preparation="compile", fused_step=True)

    def __init__(self, threads: int | None = None, compiler: Union[str, Callable] = "inductor",
                 fused_step: bool = False):
        """fused_step: the engine's whole decode step as one graph (lantern.engine.fused)."""
        super().__init__(threads)
        self.compiler, self.fused_step = compiler, fused_step

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), supports_graphs=True)

    def make_runner(self, target, drafter, spec: StaticSpec, device: torch.device) -> Runner:
        return CompiledRunner(target, drafter, spec, device, compiler=self.compiler, fused=self.fused_step)


class CUDAGraphBackend(CompilingBackend, CUDABackend):
    """cuda-graph: inductor with mode="reduce-overhead", i.e. each static step replayed as a CUDA graph."""

    name = "cuda-graph"
    abilities = dataclasses.replace(CUDABackend.abilities, preparation="compile", fused_step=True)

    def __init__(self, device_index: int = 0, fused_step: bool = False, tf32: bool = True):
        """fused_step: the engine's whole decode step recorded as one CUDA graph (lantern.engine.fused)."""
        super().__init__(device_index, tf32)
        self.fused_step = fused_step

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), supports_graphs=True)

    def make_runner(self, target, drafter, spec: StaticSpec, device: torch.device) -> Runner:
        return CompiledRunner(target, drafter, spec, device, compiler="inductor", mode="reduce-overhead",
                              fused=self.fused_step)
