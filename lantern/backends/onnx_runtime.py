"""ONNX Runtime backend: every static step is an exported graph run by an InferenceSession with IO binding.

The KV caches are OrtValues allocated once on the execution provider's device and bound as both input
`k{i}` and output `k{i}_out` of every graph (safe: see onnx_export.py); step inputs are bound from the
caller's torch tensors and logits/features are written straight into torch tensors allocated for the
call, so no model math runs in torch and the cache never crosses to the host.

Where the step tensors live (the runner's `device`): on the provider's GPU when the CUDA provider started and
torch has CUDA (ONNX Runtime then runs on torch's current stream, so no wait is needed between them); on the host
otherwise, said in a warning and in the profile (`ort.io_device`), since every step's inputs and outputs then
cross to the host.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from lantern.backends.base import (Abilities, Availability, Backend, BackendUnavailable, Capabilities, MemoryReport,
                                   Runner, StaticSpec, StepOutput, dummy_step_inputs, parse_dtype)
from lantern.backends.memory import HostPeak
from lantern.backends.onnx_export import cache_rows, ensure_graphs

OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "all": "ORT_ENABLE_ALL"}
NUMPY = {torch.int64: np.int64, torch.bool: np.bool_, torch.float32: np.float32, torch.float16: np.float16}
HOST_ONLY = " (host memory: the CUDA execution provider's device memory is not in it)"
INSTALL_HINT = {"onnx": "pip install 'lantern-decoding[onnx]'",
                "onnx-cuda": "pip install 'lantern-decoding[onnx-gpu]'"}


def _import_ort(name: str):
    """(onnxruntime, "") or (None, why it cannot be imported); imported lazily, never at module scope."""
    try:
        import onnxruntime  # the onnx extra
    except ImportError:
        return None, f"onnxruntime is not installed ({INSTALL_HINT[name]})"
    return onnxruntime, ""


def session_options(ort, threads: Optional[int], opt_level: str, spin: bool = False,
                    profile_prefix: Optional[str] = None):
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"unknown graph optimisation level {opt_level!r}; allowed: {', '.join(OPT_LEVELS)}")
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVELS[opt_level])
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    # idle ORT threads spin-wait by default, stealing the cores the host-side sampling and acceptance need
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    so.log_severity_level = 3  # errors only: ORT's provider fallback is reported by us, once, as a warning
    return so


def describe_options(so) -> dict:
    return {"intra_op_num_threads": so.intra_op_num_threads, "inter_op_num_threads": so.inter_op_num_threads,
            "graph_optimization_level": str(so.graph_optimization_level).split(".")[-1],
            "execution_mode": str(so.execution_mode).split(".")[-1], "enable_cpu_mem_arena": so.enable_cpu_mem_arena,
            "enable_mem_pattern": so.enable_mem_pattern,
            "intra_op_allow_spinning": so.get_session_config_entry("session.intra_op.allow_spinning") == "1"}


class _Graph:
    """One session and its IO binding; the caches are bound once, step data on every call."""

    def __init__(self, session, caches: dict):
        self.session = session
        self.binding = session.io_binding()
        self.input_shapes = {i.name: tuple(i.shape) for i in session.get_inputs()}
        for name, value in caches.items():
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(f"{name}_out", value)  # in place: past and present are one buffer

    def run(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        """Binds each tensor where it lives (host or CUDA device) and runs the graph."""
        for name, t in list(inputs.items()) + list(outputs.items()):
            bind = self.binding.bind_input if name in inputs else self.binding.bind_output
            bind(name, t.device.type, t.device.index or 0, NUMPY[t.dtype], tuple(t.shape), t.data_ptr())
        self.session.run_with_iobinding(self.binding)


def io_device(ort_device: tuple[str, int], torch_has_cuda: bool) -> torch.device:
    """Where a runner's step tensors live: on the provider's GPU where torch can hold tensors there, else the host."""
    kind, index = ort_device
    return torch.device("cuda", index) if kind == "cuda" and torch_has_cuda else torch.device("cpu")


class ORTRunner(Runner):
    backend_name = "onnx"

    def __init__(self, ort, paths: dict[str, Path], model_config, spec: StaticSpec, providers: list,
                 settings: dict, profile_prefix: Optional[str] = None):
        """settings: session_options keywords (threads, opt_level, spin)."""
        self.ort, self.paths, self.providers, self.settings = ort, paths, providers, settings
        self.options = session_options(ort, profile_prefix=profile_prefix, **settings)
        self.fallback_reason = ""
        self.sessions = {name: self._session(path) for name, path in paths.items()}
        self.provider = next(iter(self.sessions.values())).get_providers()[0]
        name, options = _provider_pair(self.providers[0])  # after any fallback, the provider that started
        self.ort_device = ("cuda", options.get("device_id", 0)) if name == "CUDAExecutionProvider" else ("cpu", 0)
        super().__init__(spec, io_device(self.ort_device, torch.cuda.is_available()), model_config)
        cfg, self.out_dtype = model_config, parse_dtype(spec.dtype)
        shape, dtype = (cache_rows(spec.batch, spec.max_len, cfg), cfg.head_dim), NUMPY[self.out_dtype]
        self.target_kv = {f"{kv}{i}": self._zeros(shape, dtype) for kv in "kv" for i in range(cfg.n_layer)}
        self.draft_kv = {f"{kv}0": self._zeros(shape, dtype) for kv in "kv"} if spec.draft_widths else {}
        self.graphs = {name: _Graph(s, self._caches_of(name)) for name, s in self.sessions.items()}
        self.dim, self.vocab = cfg.dim, cfg.vocab_size
        # each session holds its own copy of the weights: the graph files are what is held
        self.graph_bytes = {n: sum(f.stat().st_size for f in p.parent.iterdir() if f.is_file())
                            for n, p in paths.items()}
        self.weights_bytes = sum(b for n, b in self.graph_bytes.items() if not n.startswith("commit"))
        self.ort_memory: dict[str, dict] = {}
        self.peak = HostPeak()
        self.reset_peak_memory()

    def _caches_of(self, step: str) -> dict:
        return self.draft_kv if step.startswith("draft") else self.target_kv

    def _session(self, path: Path):
        """A session on the first provider that starts; after a fallback the rest go straight to CPU."""
        wanted = _provider_pair(self.providers[0])[0]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # ORT's own provider warning: we report it once
                session = self.ort.InferenceSession(str(path), self.options, providers=self.providers)
        except Exception as e:  # onnxruntime-gpu raises when its CUDA libraries cannot load
            if wanted == "CPUExecutionProvider":
                raise
            self.fallback_reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            session = None
        if session is None or session.get_providers()[0] != wanted:
            self.fallback_reason = self.fallback_reason or f"{wanted} is not available in this onnxruntime"
            self.providers = ["CPUExecutionProvider"]
            session = session or self.ort.InferenceSession(str(path), self.options, providers=self.providers)
        return session

    def _zeros(self, shape, dtype):
        value = self.ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, *self.ort_device)
        value.update_inplace(np.zeros(shape, dtype=dtype))  # allocated once on the device, zeroed in place
        return value

    def _step(self, name: str, inputs: dict[str, torch.Tensor]) -> StepOutput:
        if name not in self.graphs:
            kind = name.split("[")[0]
            widths = self.spec.verify_widths if kind == "verify" else self.spec.draft_widths
            raise ValueError(f"{kind} width {name[len(kind) + 1:-1]} is not a prepared static width; allowed: "
                             f"{', '.join(map(str, widths)) or 'none (no drafter)'}")
        graph = self.graphs[name]
        for key, t in inputs.items():
            if tuple(t.shape) != graph.input_shapes[key]:
                raise ValueError(f"{name}: input {key!r} has shape {tuple(t.shape)}, the graph takes "
                                 f"{graph.input_shapes[key]}")
        inputs = {k: t.detach().to(self.device).contiguous() for k, t in inputs.items()}
        b, t = graph.input_shapes["mask"][:2]
        logits = torch.empty(b, 1 if name == "prefill" else t, self.vocab, dtype=torch.float32,
                             device=self.device)  # prefill: the last position's
        hidden = torch.empty(b, t, self.dim, dtype=self.out_dtype, device=self.device)
        graph.run(inputs, {"logits": logits, "hidden": hidden})
        return StepOutput(logits, hidden)

    def prefill(self, cond, mask):
        dtype = torch.long if cond.dtype in (torch.int32, torch.int64) else self.out_dtype
        return self._step("prefill", {"cond": cond.to(dtype), "mask": mask.bool()})

    def verify(self, tokens, positions, slots, mask):
        return self._step(f"verify[{tokens.shape[-1]}]", {"tokens": tokens.long(), "positions": positions.long(),
                                                          "slots": slots.long(), "mask": mask.bool()})

    def draft(self, tokens, features, positions, slots, mask):
        if not self.draft_kv:
            raise RuntimeError("this runner was prepared without a drafter")
        return self._step(f"draft[{tokens.shape[-1]}]", {
            "tokens": tokens.long(), "features": features.to(self.out_dtype), "positions": positions.long(),
            "slots": slots.long(), "mask": mask.bool()})

    def commit(self, src, dst):
        self.spec.check_commit(src, dst)
        self.graphs["commit"].run({"src": src.detach().to(self.device).long().contiguous(),
                                   "dst": dst.detach().to(self.device).long().contiguous()}, {})

    def sync(self):
        """run_with_iobinding returns once the outputs are in the bound tensors; on a GPU, torch's stream (which
        ONNX Runtime shares) may still hold the inputs' copies."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def kv_bytes(self) -> int:
        return sum(int(np.prod(v.shape())) * np.dtype(NUMPY[self.out_dtype]).itemsize
                   for v in list(self.target_kv.values()) + list(self.draft_kv.values()))

    def reset_peak_memory(self):
        self.peak.reset()

    def warmup(self) -> float:
        seconds = super().warmup()
        self.ort_memory = self.measure_ort_memory()
        return seconds

    def measure_ort_memory(self) -> dict[str, dict]:
        """ORT's own arena numbers per static step: each graph in turn gets a profiled session of its own for
        one dummy call, then it is dropped (shapes are static, so one call shows every call's peak; one extra
        session at a time bounds what measuring costs)."""
        stats = {}
        with tempfile.TemporaryDirectory() as tmp:
            options = session_options(self.ort, profile_prefix=os.path.join(tmp, "ort"), **self.settings)
            for name, path in self.paths.items():
                session = self.ort.InferenceSession(str(path), options, providers=self.providers)
                real, self.graphs[name] = self.graphs[name], _Graph(session, self._caches_of(name))
                try:
                    self._run_dummy(name)
                finally:
                    self.graphs[name] = real
                stats[name] = _arena_stats(session.end_profiling())
        return stats

    def _run_dummy(self, name: str) -> None:
        """One call of step `name` on valid dummy inputs (stale cache slots are masked, never read)."""
        spec, kind = self.spec, name.split("[")[0]
        if kind == "prefill":
            p, s = spec.prefix_len, spec.max_len
            mask = torch.arange(s)[None, None, :] <= torch.arange(p)[None, :, None]
            self.prefill(self.dummy_condition(), mask.expand(spec.batch, p, s))
        elif kind == "verify":
            self.verify(*dummy_step_inputs(spec, int(name[len(kind) + 1:-1]), self.device))
        elif kind == "draft":
            tokens, positions, slots, mask = dummy_step_inputs(spec, int(name[len(kind) + 1:-1]), self.device)
            self.draft(tokens, torch.zeros(*tokens.shape, self.dim, dtype=self.out_dtype), positions, slots, mask)
        else:
            a = torch.arange(spec.commit_pairs).expand(spec.batch, -1).contiguous()
            self.commit(a, a.clone())

    def memory(self) -> MemoryReport:
        peak = self.peak.read()
        fixed = self.weights_bytes + self.kv_bytes() + self.tree_buffer_bytes()
        # a session's arena peak holds its own weights too: the workspace is what the peak holds beyond them
        arena = max((m["mem_in_use_peak"] - self.graph_bytes[n] for n, m in self.ort_memory.items()),
                    default=None)
        source = self.peak.source + (HOST_ONLY if self.ort_device[0] == "cuda" else "") + (
            "; workspace: ORT profiler mem_in_use_peak minus the graph's weights" if arena is not None else "")
        workspace = max(arena, 0) if arena is not None else max(peak - fixed, 0)
        return MemoryReport(peak_bytes=peak, weights_bytes=self.weights_bytes,
                            kv_cache_bytes=self.kv_bytes(), tree_buffer_bytes=self.tree_buffer_bytes(),
                            workspace_bytes=workspace, source=source)

    def profile(self) -> dict:
        record = super().profile()
        record["ort"] = {"version": self.ort.__version__, "provider": self.provider, "io_device": str(self.device),
                         "session_options": describe_options(self.options), "graphs": {
                             n: str(p) for n, p in self.paths.items()}, "memory_per_step": self.ort_memory}
        return record


def _provider_pair(entry) -> tuple[str, dict]:
    return (entry, {}) if isinstance(entry, str) else entry


def _arena_stats(profile_path: str) -> dict:
    """Peak bytes in use and held by ORT's arena over one profiled session, from its node events."""
    with open(profile_path) as f:
        events = [e.get("args", {}) for e in json.load(f) if e.get("cat") == "Node"]
    Path(profile_path).unlink(missing_ok=True)
    peak = max((int(a.get("mem_in_use_peak", 0)) for a in events), default=0)
    held = max((int(a.get("mem_arena_held", 0)) for a in events), default=0)
    return {"mem_in_use_peak": peak, "mem_arena_held": held}


class ONNXBackend(Backend):
    """ONNX Runtime on its CPU execution provider."""

    name = "onnx"
    abilities = Abilities(device_kind="cpu", preparation="export", memory_query="host")
    provider = "CPUExecutionProvider"

    def __init__(self, threads: Optional[int] = None, opt_level: str = "all", spin: bool = False,
                 cache_dir: Optional[str] = None):
        if opt_level not in OPT_LEVELS:
            raise ValueError(f"unknown graph optimisation level {opt_level!r}; allowed: {', '.join(OPT_LEVELS)}")
        self.settings = {"threads": threads, "opt_level": opt_level, "spin": spin}
        self.cache_dir = Path(cache_dir) if cache_dir else None

    @classmethod
    def availability(cls) -> Availability:
        ort, reason = _import_ort(cls.name)
        if ort is None:
            return Availability(False, reason)
        if cls.provider not in ort.get_available_providers():
            return Availability(False, f"onnxruntime {ort.__version__} has no {cls.provider} (providers: "
                                       f"{', '.join(ort.get_available_providers())}; {INSTALL_HINT[cls.name]})")
        return Availability(True)

    def capabilities(self) -> Capabilities:
        return Capabilities(device="cpu", dtypes=self.abilities.dtypes, supports_graphs=True,
                            timer="time.perf_counter (run_with_iobinding is synchronous)",
                            memory_source=HostPeak().source + " + ORT profiler mem_in_use_peak")

    @classmethod
    def supports_family(cls, family: str) -> Availability:
        if family != "llamagen":
            return Availability(False, "the ONNX export traces lantern's own LlamaGen modules only "
                                       "(lantern.backends.onnx_export)")
        return Availability(True)

    def providers(self) -> list:
        return [self.provider]

    def prepare(self, target, drafter, spec: StaticSpec) -> Runner:
        self.check_dtype(spec.dtype)
        ort, reason = _import_ort(self.name)
        if ort is None:
            raise BackendUnavailable(f"{self.name}: {reason}")
        paths = ensure_graphs(target, drafter if spec.draft_widths else None, spec, self.cache_dir)
        runner = ORTRunner(ort, paths, target.config, spec, self.providers(), self.settings)
        runner.backend_name = self.name
        self.check_provider(runner)
        return runner

    def check_provider(self, runner: ORTRunner) -> None:
        """The CPU provider always starts."""


class ONNXCUDABackend(ONNXBackend):
    """ONNX Runtime on CUDAExecutionProvider (onnxruntime-gpu); falls back to CPU with a warning when the
    provider is listed but cannot start (onnxruntime-gpu lists it even on machines without a GPU)."""

    name = "onnx-cuda"
    abilities = Abilities(device_kind="cuda", preparation="export", memory_query="cuda")
    provider = "CUDAExecutionProvider"

    def __init__(self, device_index: int = 0, **options):
        super().__init__(**options)
        self.device_index = device_index

    def capabilities(self) -> Capabilities:
        return Capabilities(device=f"cuda:{self.device_index}", dtypes=self.abilities.dtypes, supports_graphs=True,
                            timer="time.perf_counter (run_with_iobinding is synchronous)",
                            memory_source=HostPeak().source + HOST_ONLY + " + ORT profiler mem_in_use_peak")

    def providers(self) -> list:
        options = {"device_id": self.device_index}
        if torch.cuda.is_available():  # ONNX Runtime runs on torch's stream: inputs torch wrote are ready in order
            options["user_compute_stream"] = str(torch.cuda.current_stream(self.device_index).cuda_stream)
        return [(self.provider, options), "CPUExecutionProvider"]

    def check_provider(self, runner: ORTRunner) -> None:
        if runner.provider != self.provider:
            warnings.warn(f"{self.name}: {self.provider} could not start ({runner.fallback_reason}); running on "
                          f"{runner.provider} instead", RuntimeWarning, stacklevel=3)
        elif runner.device.type != "cuda":
            warnings.warn(f"{self.name}: {self.provider} runs the graphs, but torch {torch.__version__} has no CUDA, "
                          "so every step's inputs and outputs cross to the host (io_device cpu)", RuntimeWarning,
                          stacklevel=3)
