"""The backend contract: a few static-shape steps over preallocated KV caches, plus a profile.

A backend turns (target, drafter, StaticSpec) into a `Runner`. The decoding core only ever calls:

    prefill(cond, mask)                                   -> StepOutput: logits at the last prefix position
                                                             (T = 1), features at every one (T = P)
    verify(tokens, positions, slots, mask)                -> StepOutput, T in spec.verify_widths
    draft(tokens, features, positions, slots, mask)       -> StepOutput, T in spec.draft_widths
    commit(src, dst)                                      compaction inside the target's KV cache,
                                                          src and dst exactly (B, spec.commit_pairs)
    phase(name)                                           timing context (base: syncs the device; torch on
                                                          CUDA: events, resolved when `times` is read)
    sync(), profile(), warmup() (optional: default runs every static step once)
    fused_steps()                                         (optional) the fused step, a capability some graph
                                                          runners have (FusedSteps); default None

Every argument is a tensor of a fixed shape (positions, slots and lengths included: never Python ints that
would key a new graph), on the runner's device; `mask` is (B, T, S) bool over all S cache slots, built by the
core. The drafter's cache needs no commit: each catch-up writes the accepted pairs at their own slots.

Output lifetime: a step's StepOutput stays valid (unchanged) until the next call of the SAME step (same name
and width); a graph replay may reuse its output buffers after that. The core reads or copies what it keeps
before it calls that step again.

Capabilities the core reads: `device` (where inputs and the generator live) and `dtypes` (the first is the
default). `supports_graphs`, `timer` and `memory_source` are reported in `lantern backends` and profiles,
and `supports_graphs` tells the conformance kit to count graphs.

What a backend can do is declared once on its class, `Backend.abilities` (an `Abilities`): the device kind its
runners use, what preparing a runner costs, whether it runs the fused step, whether phases are timed by device
events, how the memory still free is read, which dtypes it computes in. The planner (lantern.plan.backend_choice),
the command line and the memory checks (lantern.backends.memory) read these declarations, never a list of backend
names.
"""
from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Callable, ClassVar, Iterator, NamedTuple, Optional

import torch

from lantern.models.family import neutral_conditions

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


class BackendUnavailable(RuntimeError):
    """A known backend that cannot run on this machine; the message is '<name>: <reason>'."""


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""  # why not, when not ok


@dataclass(frozen=True)
class Capabilities:
    device: str  # "cpu", "cuda:0", "hpu", ...
    dtypes: tuple[str, ...]
    supports_graphs: bool  # steps are captured once and replayed
    timer: str  # what phase timing rests on
    memory_source: str  # what peak memory rests on
    fp32_matmul: str = "fp32"  # what an fp32 matrix product computes in: "fp32", or "tf32" (CUDA tensor cores)


PREPARATIONS = ("none", "compile", "export", "capture")  # what preparing a runner costs, cheapest first
MEMORY_QUERIES = ("host", "cuda", "none")  # how the memory still free is read (lantern.backends.memory)


@dataclass(frozen=True)
class Abilities:
    """What a backend can do, declared on its class (`Backend.abilities`) so that it is known before one is built."""

    device_kind: str = "cpu"  # the kind of device its runners use ("cpu", "cuda", "hpu", ...): auto weighs together
    # the backends of the default backend's kind
    preparation: str = "none"  # a runner's one-time cost (PREPARATIONS): none (eager), compile (one graph per static
    # step), export (an ONNX graph), capture (device graphs recorded per static step)
    fused_step: bool = False  # takes fused_step=True: the engine's whole decode step as one graph (FusedSteps)
    device_events: bool = False  # phases are timed by device events, resolved when read (else the host clock with
    # the device synced on both ends)
    memory_query: str = "none"  # how the memory still free is read (MEMORY_QUERIES; none: lantern cannot tell)
    dtypes: tuple[str, ...] = ("fp32",)  # the dtypes its runners compute in, its preferred one first (auto weighs the
    # modes that run the request's dtype without building a backend to ask)

    def __post_init__(self):
        if self.preparation not in PREPARATIONS:
            raise ValueError(f"unknown preparation {self.preparation!r}; allowed: {', '.join(PREPARATIONS)}")
        if self.memory_query not in MEMORY_QUERIES:
            raise ValueError(f"unknown memory query {self.memory_query!r}; allowed: {', '.join(MEMORY_QUERIES)}")


@dataclass(frozen=True)
class StaticSpec:
    """Every shape a runner will ever see. The core pads its calls to exactly these."""

    batch: int  # rows per step: 2 per image with CFG ([cond; uncond]), 1 without
    max_len: int  # KV slots per row
    prefix_len: int  # condition tokens (1 for c2i)
    verify_widths: tuple[int, ...]  # T of target steps: 1 for AR, N (root + drafted nodes) for a tree
    draft_widths: tuple[int, ...] = ()  # T of drafter steps; empty = no drafter
    dtype: str = "fp32"
    commit_width: Optional[int] = None  # slot pairs per commit (longest accepted path + root); None = widest step
    draft_prefix: int = 0  # prefix pairs the drafter reads at prefill (one of draft_widths), at slots 1..; 0: none

    def __post_init__(self):
        parse_dtype(self.dtype)
        for name in ("batch", "max_len", "prefix_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"StaticSpec.{name} must be >= 1, got {getattr(self, name)}")
        widths = self.verify_widths + self.draft_widths
        if not self.verify_widths or min(widths) < 1 or max(widths) > self.max_len - self.prefix_len:
            raise ValueError(f"step widths {widths} must be in [1, max_len - prefix_len = "
                             f"{self.max_len - self.prefix_len}]")
        if self.commit_width is not None and not 1 <= self.commit_width <= self.max_len - self.prefix_len:
            raise ValueError(f"commit_width {self.commit_width} must be in [1, {self.max_len - self.prefix_len}]")
        if self.draft_prefix and (self.draft_prefix >= self.prefix_len or self.draft_prefix not in self.draft_widths):
            raise ValueError(f"draft_prefix {self.draft_prefix} must be below prefix_len {self.prefix_len} and one "
                             f"of draft_widths {self.draft_widths}")

    @property
    def draft_first_slot(self) -> int:
        """The drafter's first cache slot: 1 when it reads the prefix (its pairs sit at positions 1..P-1), else P."""
        return self.prefix_len - self.draft_prefix

    @property
    def commit_pairs(self) -> int:
        """A: slot pairs of every commit (the core pads shorter ones: one static shape)."""
        return self.commit_width or max(self.verify_widths + self.draft_widths)

    def check_commit(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        want = (self.batch, self.commit_pairs)
        if tuple(src.shape) != want or tuple(dst.shape) != want:
            raise ValueError(f"commit takes src and dst of shape (batch, commit_pairs) = {want}; got "
                             f"{tuple(src.shape)} and {tuple(dst.shape)}")

    @property
    def static_steps(self) -> list[str]:
        """Names of the distinct static steps (one compiled graph each in graph mode)."""
        steps = ["prefill"] + [f"verify[{t}]" for t in self.verify_widths]
        steps += [f"draft[{t}]" for t in self.draft_widths]
        return steps + ["commit"]


class StepOutput(NamedTuple):
    logits: torch.Tensor  # (B, T, V) float32
    hidden: torch.Tensor  # (B, T, D) final-normed features, in the runner's dtype (prefill: (B, P, D))


@dataclass
class PhaseTimes:
    seconds: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        s = sorted(self.seconds)
        n = len(s)
        if n == 0:
            return {"count": 0, "total_s": 0.0}
        return {"count": n, "total_s": sum(s), "median_s": s[n // 2], "min_s": s[0], "max_s": s[-1]}


@dataclass
class MemoryReport:
    peak_bytes: int  # the true peak since the last reset (lantern.backends.memory): allocator or process
    weights_bytes: int
    kv_cache_bytes: int
    tree_buffer_bytes: int  # the static inputs of the widest step (tokens, positions, slots, mask)
    workspace_bytes: int  # what the peak holds beyond the parts above (activations, allocator slack)
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


class Runner(ABC):
    """A model prepared for one StaticSpec on one backend."""

    backend_name: ClassVar[str] = ""
    trims_attention = False  # True: a step attends only the cache slots in use (eager CPU), else the whole cache
    attention_floor = 0  # a trimming runner attends at least this many slots (attend_at_least)
    bounds_attention = False  # True: verify reads only the slots below the engine's bound (attend_until; cpu-graph)
    fused_warmup_seconds = 0.0  # what its fused step's compiles and captures took so far (0: it has none)
    # a weak reference to the engine whose requests hold this runner's KV cache (lantern.engine.Engine claims the
    # runner when it takes requests); None until one does
    engine_in_flight: Optional[Callable[[], object]] = None

    def __init__(self, spec: StaticSpec, device: torch.device, model_config):
        self.spec = spec
        self.device = device
        self.model_config = model_config  # the target's GPTConfig
        self._times: dict[str, PhaseTimes] = {}
        self.warmup_seconds = 0.0

    @abstractmethod
    def prefill(self, cond: torch.Tensor, mask: torch.Tensor) -> StepOutput:
        """cond: class ids (B,) or caption embeddings (B, P, C); mask (B, P, S). Writes slots 0..P-1.
        Returns the last prefix position's logits (B, 1, V) and every prefix position's features (B, P, D)."""

    @abstractmethod
    def verify(self, tokens, positions, slots, mask) -> StepOutput:
        """Target forward over T tokens (B, T) at `positions`, written to `slots`, attending by mask."""

    @abstractmethod
    def draft(self, tokens, features, positions, slots, mask) -> StepOutput:
        """Drafter forward over T (feature, token) pairs into the drafter's own cache."""

    @abstractmethod
    def commit(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy target-cache slots src -> dst, both (B, spec.commit_pairs), every layer (reads before writes)."""

    @abstractmethod
    def sync(self) -> None:
        """Wait for the device."""

    @abstractmethod
    def memory(self) -> MemoryReport:
        """The true peak since prepare() or the last reset_peak_memory(), and what it is made of."""

    def reset_peak_memory(self) -> None:
        """(optional) Start a new peak-memory window (Pipeline.generate: one per generation); default: nothing to
        reset. A runner that offers it reads its peak from lantern.backends.memory."""

    def dummy_condition(self) -> torch.Tensor:
        """A valid condition for every row of the prepared batch (lantern.models.family.neutral_conditions)."""
        return neutral_conditions(self.model_config, self.spec.batch, self.device)

    def fused_steps(self) -> Optional[FusedSteps]:
        """(optional) This runner as the fused step sees it, where the engine's whole decode step runs as one graph
        on it (lantern.engine.fused); default None: the engine calls the steps one by one."""
        return None

    def attend_until(self, end: int) -> None:
        """(optional) The engine's bound for its next step: no running row attends a cache slot at or past `end`
        (a row not running may; its outputs are discarded). A runner that can then read only the first `end`
        slots does (cpu-graph); default: ignored (eager trims by the mask itself, recorded graphs keep one
        shape)."""

    @contextlib.contextmanager
    def attend_at_least(self, slots: int) -> Iterator[None]:
        """Every step inside attends over at least the first `slots` cache slots (more where in use), so it
        costs what it costs once an image is that far along (calibration times an image's first steps at its
        middle's width). Nothing changes for a runner that attends over the whole cache anyway."""
        floor, self.attention_floor = self.attention_floor, slots
        try:
            yield
        finally:
            self.attention_floor = floor

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Wall time of a phase, the device synced on both ends so the time is the work's own."""
        self.sync()
        t0 = time.perf_counter()
        yield
        self.sync()
        self.add_time(name, time.perf_counter() - t0)

    def add_time(self, name: str, seconds: float) -> None:
        self._times.setdefault(name, PhaseTimes()).seconds.append(seconds)

    @property
    def times(self) -> dict[str, PhaseTimes]:
        """Each phase's timings so far; reading them first resolves what the device still owes (`resolve_times`)."""
        self.resolve_times()
        return self._times

    def resolve_times(self) -> None:
        """(optional) Turn timings still pending on the device into seconds; default: nothing is pending."""

    def reset_times(self) -> None:
        self._times = {}

    def warmup(self) -> float:
        """(optional) Run every static step once on dummy data (graph backends capture here).
        Returns the seconds it took; default: one call of each step."""
        t0 = time.perf_counter()
        run_every_static_step(self)
        self.sync()
        self.warmup_seconds = time.perf_counter() - t0
        return self.warmup_seconds

    def profile(self) -> dict:
        """The profile record: phase times, memory and what it is made of, warm-up, the static spec."""
        return {
            "backend": self.backend_name,
            "device": str(self.device),
            "spec": asdict(self.spec),
            "warmup_s": self.warmup_seconds,
            "phases": {k: v.summary() for k, v in self.times.items()},
            "memory": self.memory().to_dict(),
        }

    def tree_buffer_bytes(self) -> int:
        """Bytes of the widest step's static inputs: tokens, positions, slots (int64) and the bool mask."""
        t = max(self.spec.verify_widths + self.spec.draft_widths)
        b, s = self.spec.batch, self.spec.max_len
        return b * t * 8 * 3 + b * t * s


def dummy_step_inputs(spec: StaticSpec, width: int, device) -> tuple[torch.Tensor, ...]:
    """Valid inputs of one step of `width` tokens right after the prefix (used by warm-ups and tests)."""
    b, p, s = spec.batch, spec.prefix_len, spec.max_len
    tokens = torch.zeros(b, width, dtype=torch.long, device=device)
    positions = (p + torch.arange(width, device=device)).expand(b, width).contiguous()
    slots = positions.clone()
    mask = torch.arange(s, device=device)[None, None, :] <= positions[:, :, None]
    return tokens, positions, slots, mask


def run_prefill(runner: Runner) -> StepOutput:
    """One prefill of a dummy condition (warm-ups)."""
    spec, dev = runner.spec, runner.device
    b, p, s = spec.batch, spec.prefix_len, spec.max_len
    pmask = (torch.arange(s, device=dev)[None, None, :] <= torch.arange(p, device=dev)[None, :, None])
    return runner.prefill(runner.dummy_condition(), pmask.expand(b, p, s).contiguous())


def run_every_static_step(runner: Runner) -> None:
    spec, dev = runner.spec, runner.device
    b = spec.batch
    out = run_prefill(runner)
    for t in spec.verify_widths:
        runner.verify(*dummy_step_inputs(spec, t, dev))
    for t in spec.draft_widths:
        tokens, positions, slots, mask = dummy_step_inputs(spec, t, dev)
        feats = out.hidden[:, -1:].expand(b, t, -1).contiguous()
        runner.draft(tokens, feats, positions, slots, mask)
    a = torch.arange(spec.commit_pairs, device=dev).expand(b, -1).contiguous()
    runner.commit(a, a.clone())


class FusedSteps(ABC):
    """The fused step, a capability of the graph runners that have it (`Runner.fused_steps()` returns the runner
    as a FusedSteps): what lantern.engine.fused calls, besides the Runner contract, to run an engine's whole decode
    step as one graph per static step."""

    @abstractmethod
    def inside(self):
        """The view of the runner the fused step is traced against: its steps as code inside the one graph."""

    @abstractmethod
    def fused_warm(self, decode) -> bool:
        """Whether an engine of this DecodeConfig has compiled (and captured) its fused step on this runner."""

    @abstractmethod
    def mark_fused_warm(self, decode) -> None:
        """An engine of this DecodeConfig has: its later engines pay no compile."""

    @abstractmethod
    def take_attended(self) -> int:
        """The cache slots the next verify reads (the engine's bound for this step, `Runner.attend_until`, used up:
        a later caller never inherits it)."""

    @abstractmethod
    def add_fused_warmup(self, seconds: float) -> None:
        """An engine's fused step spent `seconds` compiling or capturing at its first steps: the runner counts them in
        its warm-up (`fused_warmup_seconds` and `warmup_seconds`)."""

    def capture_step(self, fn: Callable) -> Callable:
        """(optional) fn, the fused step function, as this mode compiles it (once per runner: every engine on the
        runner shares it); default: fn itself, captured whole by `replayable`."""
        return fn

    def replayable(self, call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """(optional) One engine's step, `call()` -> its report over the engine's persistent buffers, as this mode
        replays it; default: called as it is."""
        return call


class Backend(ABC):
    """A way of running the static steps. Subclasses: name, availability(), capabilities(), prepare(), and what they
    can do in `abilities` (default: an eager CPU backend that can tell nothing of its memory)."""

    name: ClassVar[str] = ""
    abilities: ClassVar[Abilities] = Abilities()

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Whether it can run here, and why not. Must not import a heavy SDK at module scope."""

    @abstractmethod
    def capabilities(self) -> Capabilities:
        ...

    fused_step = False  # (optional) its runners run the engine's whole decode step as one graph (FusedSteps); only
    # a backend whose abilities declare fused_step takes it


    @abstractmethod
    def prepare(self, target, drafter, spec: StaticSpec) -> Runner:
        """Place the models (and a drafter, or None) for this spec; allocate caches once."""

    @classmethod
    def fused_step_problem(cls, target) -> Optional[str]:
        """(optional) Why the engine's step cannot run as one graph on this backend's runners of `target` (None: it
        can); default: it cannot where the abilities declare no fused step."""
        return None if cls.abilities.fused_step else f"the {cls.name} backend has no fused step"

    @classmethod
    def forget_prepared(cls) -> None:
        """(optional) Drop what this process prepared that a new process would prepare again (compiled graphs), so
        the next preparation pays what a later process pays; default: nothing is kept."""

    @classmethod
    def supports_family(cls, family: str) -> Availability:
        """(optional) Whether this backend runs targets of a model family (lantern.models.family); default:
        every family, as backends that call the torch step modules do."""
        return Availability(True)

    def check_family(self, family: str) -> None:
        """Raise BackendUnavailable, with the reason, for a family this backend does not run."""
        avail = self.supports_family(family)
        if not avail.ok:
            raise BackendUnavailable(f"{self.name}: unavailable for the {family} family: {avail.reason}")

    def check_dtype(self, dtype: str) -> None:
        allowed = self.capabilities().dtypes
        if dtype not in allowed:
            raise ValueError(f"dtype {dtype!r} is not supported by backend {self.name!r}; allowed: "
                             f"{', '.join(allowed)}")


def describe(backend_cls: type[Backend], options: Optional[dict] = None) -> dict:
    """One line of `lantern backends`: available or why not, device, dtypes."""
    avail = backend_cls.availability()
    row = {"name": backend_cls.name, "available": avail.ok, "reason": avail.reason}
    if avail.ok:
        caps = backend_cls(**(options or {})).capabilities()
        row.update(device=caps.device, dtypes=list(caps.dtypes), supports_graphs=caps.supports_graphs)
    return {**row, **asdict(backend_cls.abilities)}
