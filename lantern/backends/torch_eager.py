"""PyTorch eager backend: the reference. Device `cuda` (CUDA allocator stats) or the same code on `cpu`.

Every torch-based backend (eager, graph modes, HPU) places the models once per (device, dtype) and shares
those copies among all the runners it prepares (`SharedWeights`): a Pipeline with several static shapes
holds one copy of the weights, and the caller's fp32 models are never changed."""
from __future__ import annotations

import contextlib

import torch

from lantern.backends.base import (Abilities, Availability, Backend, Capabilities, MemoryReport, Runner,
                                   StaticSpec, StepOutput, parse_dtype)
from lantern.backends.memory import AllocatorPeak, HostPeak
from lantern.backends.torch_steps import CacheCommit, DraftStep, TargetPrefill, TargetStep, make_caches
from lantern.models.placement import placed_copy


MAX_PENDING_PHASES = 4096  # CUDA phase marks held before those already done are resolved (bounds a long service)


def module_bytes(*modules) -> int:
    seen, total = set(), 0
    for m in modules:
        if m is None:
            continue
        for t in list(m.parameters()) + [b for n, b in m.named_buffers() if "rope" in n]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def is_cuda(device: torch.device) -> bool:
    """The one place the torch runners ask which device they are on."""
    return device.type == "cuda"


class SharedWeights:
    """Mixin of torch backends: the models placed on (device, dtype) once, shared by every runner prepared."""

    def placed(self, target, drafter, device: torch.device, dtype: str):
        cache = self.__dict__.setdefault("_placed", {})
        key = (id(target), id(drafter), str(device), dtype)
        if key not in cache:
            t = parse_dtype(dtype)
            # the target places itself (lantern.models.family: a copy where device or dtype differ) and the drafter
            # is copied, so preparing never changes the caller's models
            tc = target.placed(device, t)
            dc = placed_copy(drafter, device, t) if drafter is not None else None
            cache[key] = (target, drafter, tc, dc)  # the originals are kept so their ids stay theirs
        return cache[key][2:]


class TorchRunner(Runner):
    """Calls the step modules; subclasses swap `wrap_step` to capture them (graph modes).
    target and drafter are already placed on the device in the spec's dtype (SharedWeights)."""

    backend_name = "cpu"
    threads: int | None = None  # torch intra-op threads inside steps (None: torch's own setting)
    trims_attention = True  # eager on a CPU: attention reads only the slots some row attends (see `live_slots`)

    def __init__(self, target, drafter, spec: StaticSpec, device: torch.device):
        super().__init__(spec, device, target.config)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA phases not yet resolved
        self.target = target
        self.drafter = drafter if spec.draft_widths else None
        if spec.draft_widths and self.drafter is None:
            raise ValueError("StaticSpec has draft widths but no drafter was given")
        self.target_cache, self.draft_cache = make_caches(self.target, spec, parse_dtype(spec.dtype), device,
                                                          spare=int(self.bounds_attention))
        # the eager step modules (graph modes' fused step calls these inside its one graph), then as called
        self.modules = {"prefill": TargetPrefill(self.target, self.target_cache),
                        "verify": TargetStep(self.target, self.target_cache),
                        "commit": CacheCommit(self.target_cache)}
        if self.drafter is not None:
            self.modules["draft"] = DraftStep(self.target, self.drafter, self.draft_cache)
        self.steps = {name: self.wrap_step(name, module) for name, module in self.modules.items()}
        self.weights_bytes = module_bytes(self.target, self.drafter)
        self.peak = self.peak_meter()
        self.reset_peak_memory()

    def peak_meter(self):
        """What this runner's peak is read from (lantern.backends.memory): CUDA's allocator, else the process."""
        return AllocatorPeak(torch.cuda, "torch.cuda", self.device) if is_cuda(self.device) else HostPeak()

    def wrap_step(self, name: str, module: torch.nn.Module):
        """Eager: the module itself."""
        return module

    @contextlib.contextmanager
    def _threads(self):
        """Run a step with the backend's thread count, then give torch its own setting back."""
        if not self.threads:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _run(self, name: str, *args):
        with torch.inference_mode(), self._threads():
            return self.steps[name](*args)

    def live_slots(self, mask: torch.Tensor) -> torch.Tensor:
        """mask (B, T, S) -> (B, T, s): the slots up to the last one any row attends (at least
        `attention_floor`). Attention over the rest of the cache adds exactly nothing (softmax weight 0), and
        early in an image most of it is unused. Eager on a CPU only: finding s reads the mask on the host, free
        on a CPU but a stall on a GPU, and graph modes keep every shape static."""
        if not self.trims_attention or is_cuda(self.device):
            return mask
        used = mask.flatten(0, 1).any(0).nonzero()  # (n, 1) slots some row attends
        end = max(int(used[-1]) + 1 if len(used) else mask.shape[-1], self.attention_floor)
        return mask[..., :end]

    def prefill(self, cond, mask):
        return StepOutput(*self._run("prefill", cond, self.live_slots(mask)))

    def verify(self, tokens, positions, slots, mask):
        return StepOutput(*self._run("verify", tokens, positions, slots, self.live_slots(mask)))

    def draft(self, tokens, features, positions, slots, mask):
        if self.drafter is None:
            raise RuntimeError("this runner was prepared without a drafter")
        return StepOutput(*self._run("draft", tokens, features, positions, slots, self.live_slots(mask)))

    def commit(self, src, dst):
        self.spec.check_commit(src, dst)
        self._run("commit", src, dst)

    def sync(self):
        if is_cuda(self.device):
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        """On CUDA, time the phase with CUDA events (device time between two stream marks), never waiting for
        the device here: the marks are resolved when the times are read (`resolve_times`), or, past
        `MAX_PENDING_PHASES`, those the device has already passed."""
        if not is_cuda(self.device):
            with super().phase(name):
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((name, start, end))
        if len(self._pending) > MAX_PENDING_PHASES:
            self._resolve(wait=False)

    def resolve_times(self):
        self._resolve(wait=True)

    def _resolve(self, wait: bool) -> None:
        """Pending phases into seconds: all of them after one wait for the last mark (every earlier mark is on
        the same stream, so done by then), or without waiting only those whose end mark the device has passed."""
        pending = self._pending
        if not pending:
            return
        if wait:
            pending[-1][2].synchronize()
        done = len(pending) if wait else next((i for i, (_, _, end) in enumerate(pending) if not end.query()),
                                              len(pending))
        for name, start, end in pending[:done]:
            self.add_time(name, start.elapsed_time(end) / 1e3)
        del pending[:done]

    def reset_times(self):
        super().reset_times()
        self._pending = []

    def kv_bytes(self) -> int:
        return self.target_cache.nbytes + (self.draft_cache.nbytes if self.draft_cache is not None else 0)

    def reset_peak_memory(self):
        self.peak.reset()

    def memory(self) -> MemoryReport:
        fixed = self.weights_bytes + self.kv_bytes() + self.tree_buffer_bytes()
        peak = self.peak.read()  # on a CPU the process's: weights, caches, interpreter and libraries inside it
        return MemoryReport(peak_bytes=peak, weights_bytes=self.weights_bytes, kv_cache_bytes=self.kv_bytes(),
                            tree_buffer_bytes=self.tree_buffer_bytes(), workspace_bytes=max(peak - fixed, 0),
                            source=self.peak.source)


class CPUBackend(SharedWeights, Backend):
    name = "cpu"
    abilities = Abilities(device_kind="cpu", preparation="none", memory_query="host", dtypes=("fp32", "bf16"))
    runner_cls = TorchRunner

    def __init__(self, threads: int | None = None):
        """threads: torch's intra-op threads while this backend's steps run (None: leave torch's setting)."""
        self.threads = threads

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    def capabilities(self) -> Capabilities:
        return Capabilities(device="cpu", dtypes=self.abilities.dtypes, supports_graphs=False,
                            timer="time.perf_counter", memory_source=HostPeak().source)

    def prepare(self, target, drafter, spec: StaticSpec) -> Runner:
        """The one prepare of the torch backends: the models placed on `device()` in the spec's dtype (shared
        between runners), then the runner this backend makes of them (`make_runner`)."""
        self.check_dtype(spec.dtype)
        device = self.device()
        runner = self.make_runner(*self.placed(target, drafter if spec.draft_widths else None, device, spec.dtype),
                                  spec, device)
        runner.backend_name = self.name
        runner.threads = self.threads
        return runner

    def device(self) -> torch.device:
        """Where this backend's runners live."""
        return torch.device("cpu")

    def make_runner(self, target, drafter, spec: StaticSpec, device: torch.device) -> Runner:
        """(optional) The runner of the placed models; default: `runner_cls` of them."""
        return self.runner_cls(target, drafter, spec, device)


def allow_tf32() -> None:
    """fp32 matrix products on CUDA run on the tensor cores in TF32 (a 10-bit mantissa: relative errors near
    3e-4). torch keeps this setting per process, so it is set where a CUDA runner is prepared, never at import."""
    torch.backends.cuda.matmul.allow_tf32 = True


class CUDABackend(CPUBackend):
    """cuda: bf16 by default; fp32 matrix products in TF32 unless `tf32=False`."""

    name = "cuda"
    abilities = Abilities(device_kind="cuda", preparation="none", device_events=True, memory_query="cuda",
                          dtypes=("bf16", "fp32", "fp16"))

    def __init__(self, device_index: int = 0, tf32: bool = True):
        super().__init__()
        self.device_index, self.tf32 = device_index, tf32

    @classmethod
    def availability(cls) -> Availability:
        if not torch.cuda.is_available():
            return Availability(False, "torch.cuda.is_available() is False (no CUDA device or a CPU-only torch "
                                       f"build: torch {torch.__version__})")
        return Availability(True)

    def capabilities(self) -> Capabilities:
        return Capabilities(device=f"cuda:{self.device_index}", dtypes=self.abilities.dtypes,
                            supports_graphs=False,
                            timer="torch.cuda.Event elapsed_time",
                            memory_source="torch.cuda.max_memory_allocated",
                            fp32_matmul="tf32" if self.tf32 else "fp32")

    def device(self) -> torch.device:
        """Where this backend's runners live (and the one switch of the process-wide TF32 setting)."""
        if self.tf32:
            allow_tf32()
        return torch.device("cuda", self.device_index)
