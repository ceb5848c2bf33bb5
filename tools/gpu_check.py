"""One prepared check of lantern's CUDA path (issue 45): correctness first, then speed, in one command that fits a
short GPU lease.

Sections, in order of value; each runs only while the budget (--budget-s) allows, and the results files are
rewritten as soon as a section (or a timing row) ends, so a run stopped at any point still leaves what it measured:
  env            GPU, driver, torch, CUDA, commit, command
  conformance    the conformance kit (`lantern backends --check`) on cuda (every dtype) and cuda-graph (bf16)
  parity         greedy tokens of every method on cpu (the reference) and on cuda, the fused step and cuda-graph
                 (embedded model, fp32, TF32 off)
  sync           whole generations of the fused step with every synchronisation counted
                 (torch.cuda.set_sync_debug_mode): the engine reads one report per step, nothing more
  cold           what a fresh `lantern generate` process pays for its first image: the first timing shape saved as
                 a bundle, AR on the fused step (bf16) in a new process with empty compile caches, again with the
                 caches it left, then the default (`--method auto`, no backend); each against issue 45's 30 s
  distribution   one lossless check on cuda: MC-SJD's and MC-SJD-PAC's token marginals against AR's (chi-square,
                 Bonferroni)
  timing         the embedded model inflated to GPT-B / GPT-L compute shapes (lantern.models.inflate), bf16, at the
                 bundle's sampling and at LlamaGen's class-to-image sampling (whole vocabulary, CFG 4.0): AR on
                 eager, cuda-graph and the fused step (the fastest is the baseline, named) against mc-sjd, mc-sjd-pac,
                 mc-sjd-relaxed, eagle2, lantern and lantern++ on --method-mode, with tokens per forward, the verify
                 cost ratio, the ceiling and peak GPU memory per row, and the default (`--method auto`, no backend
                 pinned); one image first, then the service, then 4 and 16 images
  serve          `lantern serve --backend cuda` under 16 closed-loop clients for --serve-s seconds against one
                 `lantern generate` process per image
Writes results/gpu-<device>.{json,md,png} (and copies them under $OUT when that is set) and prints a short table
last.

    python tools/gpu_check.py                    # on a CUDA machine (tools/gpu_check.sh installs what is missing)
    python tools/gpu_check.py --quick            # the same code on the CPU, tiny shapes, in a few minutes

--quick runs every section on CPU stand-ins, labelled as such in every row: `cpu` for cuda, `cpu-graph` (dynamo's
eager compiler) for cuda-graph and the fused step; the GPT-B / GPT-L shapes become a slightly inflated embedded
model, images are a few tokens long, and host reads stand in for device synchronisations. It has no time budget
unless --budget-s names one, so a busy machine skips nothing. Its numbers mean nothing; it proves the check runs
end to end (tests/docs/test_gpu_check.py). docs/gpu.md says how to read it.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from bench_step_compression import parse_row
from gpu_check_inputs import input_problems
from samplings import sampling_settings

ROOT = Path(__file__).resolve().parents[1]
# a method, or a form of one (tools/bench_step_compression.py parse_row): mc-sjd-pac's widest counted form too
SPEED_METHODS = ("mc-sjd", "mc-sjd-pac", "mc-sjd-pac:fan=60:window=48:branch_depth=3", "mc-sjd-relaxed", "eagle2",
                 "lantern", "lantern++")
RELAXED = ("lantern", "lantern++", "mc-sjd-relaxed")  # the methods that read the proximity table (k neighbours)
TINY_NEIGHBOURS = 8  # --quick's proximity table: few enough to fit the inflated vocabulary's padded codes
PARITY_ORDER = ("ar", "mc-sjd", "lantern++", "mc-sjd-relaxed", "eagle2", "lantern", "sjd", "mc-sjd-pac")
COLD_COMPILE_S = 40.0  # the longest cold compile of one timing row seen on an H100 at GPT-B (37 s): a row starts
# only with that much budget left
GOAL_FIRST_IMAGE_S = 30.0  # issue 45's goal: the fused step's first image of a cold `lantern generate` process
AUTO_CALIBRATE_S = 240.0  # the auto row, expected (not yet measured) on an H100 at GPT-B: calibrating three modes
# with AR and two plans compiled on each of the two graph modes (twice: as measured, then as a new process would)
COLD_SECTION_S = 90.0  # the cold section on an H100, expected (not yet measured): a new process that compiles cold
# (37 s inside the check's own process), two with warm caches; it starts only with that much budget left
BASELINE_S = 20.0  # seconds of one-process-per-image load: each process pays torch's import and CUDA's start
# each section's share of the budget (what it may start within); the timing rows of 4 and 16 images take the rest
SHARES = {"conformance": 0.12, "parity": 0.18, "sync": 0.05, "cold": 0.23, "distribution": 0.05, "timing-1": 0.2,
          "serve": 0.12}


@dataclasses.dataclass(frozen=True)
class Mode:
    """A way of running on the device: its label in the results, the backend and its options."""

    label: str  # eager | graph | fused
    backend: str
    options: dict

    def pipeline(self, models, dtype: str, **extra):
        from lantern.api import Pipeline
        return Pipeline(models.target, models.drafter, models.proximity, backend=self.backend, dtype=dtype,
                        **{**self.options, **extra})


def device_modes(quick: bool) -> dict[str, Mode]:
    """The modes under test: CUDA's, or their CPU stand-ins (--quick)."""
    if quick:
        return {"eager": Mode("eager", "cpu", {}),
                "graph": Mode("graph", "cpu-graph", {"compiler": "eager"}),
                "fused": Mode("fused", "cpu-graph", {"compiler": "eager", "fused_step": True})}
    return {"eager": Mode("eager", "cuda", {}), "graph": Mode("graph", "cuda-graph", {}),
            "fused": Mode("fused", "cuda-graph", {"fused_step": True})}


class Budget:
    """The seconds the check may still start work in: overall, and per section (its share)."""

    def __init__(self, seconds: Optional[float], scale: float = 1.0):
        """seconds: None for no budget (--quick unless --budget-s is given: every unit runs, however busy the
        machine); scale: multiplies every unit's minimum (--quick: 0, every unit runs while any time is left)."""
        self.total, self.scale = seconds, scale
        self.end = math.inf if seconds is None else time.monotonic() + seconds
        self.section_end = self.end

    def left(self) -> float:
        return min(self.end, self.section_end) - time.monotonic()

    def allows(self, seconds: float) -> bool:
        """Whether a unit that needs about `seconds` on a GPU (compiles included) may start."""
        return self.left() > seconds * self.scale

    def overall_left(self) -> float:
        return self.end - time.monotonic()

    def section(self, share: Optional[float]) -> None:
        now = time.monotonic()
        self.section_end = self.end if share is None or self.total is None else min(self.end,
                                                                                      now + share * self.total)


class Check:
    """One run: its settings, models, budget and the record it writes after every section."""

    def __init__(self, args, stem: Path):
        from lantern.bundle import load_bundle
        self.args, self.quick = args, args.quick
        self.modes = device_modes(args.quick)
        self.budget = Budget(args.budget_s, scale=0.0 if args.quick else 1.0)
        self.bundle = load_bundle()  # its sampling and relaxation settings; its models too, on a GPU
        self.models = tiny_models() if args.quick else Models(self.bundle.target, self.bundle.drafter,
                                                              self.bundle.proximity)
        self.stem = stem
        self.record = {"quick": args.quick, "stand_ins": {m.label: m.backend for m in self.modes.values()}
                       if args.quick else None, "budget_s": args.budget_s, "sections": {}, "skipped": []}
        self._pipes: dict = {}
        self.t0 = time.monotonic()
        earlier = self.stem.with_suffix(".json")
        self.earlier = json.loads(earlier.read_text()) if args.resume and earlier.exists() else None

    def pipe(self, mode: str, models, dtype: str, **extra):
        """One pipeline per (mode, models, dtype, options), so runners and compiled steps are reused across
        sections."""
        key = (mode, id(models), dtype, tuple(sorted(extra.items())))
        if key not in self._pipes:
            self._pipes[key] = self.modes[mode].pipeline(models, dtype, **extra)
        return self._pipes[key]

    def drop_pipes(self, models) -> None:
        for key in [k for k in self._pipes if k[1] == id(models)]:
            self._pipes.pop(key).release()

    def skip(self, what: str, why: str) -> None:
        self.record["skipped"].append(f"{what}: {why}")
        print(f"[gpu_check] skipped {what}: {why}", file=sys.stderr)

    def error(self, what: str, e: Exception) -> None:
        """A unit that broke: recorded with where it broke (the run fails), and the run goes on."""
        self.record.setdefault("errors", []).append(f"{what}: {type(e).__name__}: {e}")
        self.record.setdefault("tracebacks", {})[what] = where_it_broke(e)
        print(f"[gpu_check] {what} failed: {type(e).__name__}: {e}", file=sys.stderr)
        forget_cuda_graph_recordings()

    def save(self) -> None:
        self.record["elapsed_s"] = time.monotonic() - self.t0
        write_all(self.stem, self.record)


@dataclasses.dataclass
class Models:
    target: torch.nn.Module
    drafter: Optional[torch.nn.Module]
    proximity: Optional[torch.Tensor]


def tiny_models() -> Models:
    """--quick: a one-layer random target (its head sharpened, so greedy choices are not ties), drafter and
    proximity table, made offline by the project's own code."""
    from lantern.models.config import GPTConfig
    from lantern.models.drafter import Drafter
    from lantern.models.gpt import GPT
    from lantern.models.proximity import build_proximity_table
    torch.manual_seed(0)
    cfg = GPTConfig(dim=64, n_layer=1, n_head=4, vocab_size=64, num_classes=10, block_size=64, multiple_of=32)
    target = GPT(cfg).eval()
    with torch.no_grad():
        target.output.weight.mul_(8.0)
    codebook = torch.nn.functional.normalize(torch.randn(cfg.vocab_size, 8), dim=1)
    return Models(target, Drafter(cfg).eval(), build_proximity_table(codebook, TINY_NEIGHBOURS))


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def default_stem(quick: bool) -> Path:
    if quick:  # a check that the tool runs never lands in results/
        return Path(tempfile.mkdtemp(prefix="lantern-gpu-check-")) / "gpu-cpu-stand-in"
    return ROOT / "results" / f"gpu-{slug(torch.cuda.get_device_name())}"


# ---- env ------------------------------------------------------------------------------------------------------
def environment(check: Check) -> dict:
    from lantern.backends.environment import provenance
    prov = provenance()
    # the caller's LANTERN_COMMIT names what it sent: a lease's copy has no .git, or a stale one
    commit = os.environ.get("LANTERN_COMMIT") or prov["commit"] or "unknown"
    check.record["provenance"] = {**prov, "commit": commit, "missing": [k for k in prov["missing"] if k != "commit"]}
    env = {"command": prov["command"], "commit": commit, "machine": prov["machine"], "torch": torch.__version__,
           "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if check.quick:
        return {**env, "device": "cpu (stand-in for cuda)", "driver": None, "cuda": None}
    smi = shutil.which("nvidia-smi")
    driver = (subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip() if smi else None)
    props = torch.cuda.get_device_properties(0)
    return {**env, "device": torch.cuda.get_device_name(), "driver": driver, "cuda": torch.version.cuda,
            "gpu_memory_gib": props.total_memory / 2 ** 30, "multiprocessors": props.multi_processor_count,
            "backends": backends_here()}


def backends_here() -> dict[str, str]:
    """Every registered backend: "available", or "unavailable: why" (onnx-cuda needs onnxruntime-gpu, which an
    image with plain onnxruntime lacks; the check runs none it cannot)."""
    from lantern.backends.registry import backend_class, registered
    here = {}
    for name in sorted(registered()):
        try:
            a = backend_class(name).availability()
        except Exception as e:  # noqa: BLE001  a backend whose SDK breaks on import is a finding, not a crash
            here[name] = f"unavailable: {type(e).__name__}: {e}"
            continue
        here[name] = "available" if a.ok else f"unavailable: {a.reason}"
    return here


# ---- conformance ----------------------------------------------------------------------------------------------
def conformance(check: Check) -> dict:
    from lantern.backends.conformance import check_backend
    out = {}
    runs = [("eager", ["fp32"]), ("graph", ["bf16"])] if check.quick else [("eager", None), ("graph", ["bf16"]),
                                                                              ("graph", ["fp32"])]
    for mode, dtypes in runs:
        m = check.modes[mode]
        name = f"{m.backend} {'/'.join(dtypes) if dtypes else 'all dtypes'}"
        if not check.budget.allows(20):
            check.skip(f"conformance {name}", "budget")
            continue
        options = {k: v for k, v in m.options.items() if k != "fused_step"}
        out[name] = conformance_result(check_backend(m.backend, dtypes=dtypes, **options))
    if not check.quick and backends_here()["onnx-cuda"] == "available" and check.budget.allows(60):
        out["onnx-cuda fp32"] = conformance_result(check_backend("onnx-cuda", dtypes=["fp32"]))  # exports: a minute
    return out


def conformance_result(report) -> dict:
    checks = report.to_dict()["checks"]
    return {"passed": report.passed, "failures": [c for c in checks if c["status"] == "fail"], "checks": len(checks)}


# ---- parity ---------------------------------------------------------------------------------------------------
def method_config(check: Check, method: str, sampling):
    """The method (a name, or a form such as 'mc-sjd-pac:fan=60') at `sampling` with the bundle's relaxation
    settings (--quick: k within the tiny table)."""
    from lantern.decoding import method_preset
    name, settings = parse_row(method)
    kw = dict(check.bundle.relaxation_at(sampling).get(name, {}))
    if check.quick and name in RELAXED:
        kw["k"] = min(kw.get("k", TINY_NEIGHBOURS), TINY_NEIGHBOURS)
    return method_preset(name, sampling, **{**kw, **settings})


def greedy_config(check: Check, method: str):
    from lantern.decoding import SamplingConfig
    return method_config(check, method, SamplingConfig(**{**check.bundle.default_sampling, "greedy": True}))


def parity(check: Check) -> dict:
    """Greedy tokens of every method: the CPU's (fp32) against each device mode's (fp32, TF32 off)."""
    from lantern.api import Pipeline
    tokens, classes = check.args.parity_tokens, [0, 1]
    cpu = Pipeline(check.models.target, check.models.drafter, check.models.proximity, backend="cpu", dtype="fp32")
    exact = {} if check.quick else {"tf32": False}
    rows = {}
    with ieee_fp32():
        greedy_runs(check, cpu, exact, classes, tokens, rows)
    out = {}
    for method, by_mode in rows.items():
        ref = by_mode.pop("cpu")
        out[method] = {mode: {"equal": bool(torch.equal(ref, t.cpu())),
                              "first_difference": first_difference(ref, t.cpu())} for mode, t in by_mode.items()}
    return {"tokens_per_image": tokens, "images": len(classes), "methods": out}


def greedy_runs(check: Check, cpu, exact: dict, classes: list, tokens: int, rows: dict) -> None:
    """rows: method -> {"cpu": tokens, mode: tokens}; every method on eager first, then the compiled ones."""
    for mode in ("eager", "fused", "graph"):
        for method in PARITY_ORDER if mode == "eager" else check.args.compiled_methods:
            if not check.budget.allows(5 if mode == "eager" else 25):
                check.skip(f"parity {method} on {mode}", "budget")
                continue
            dcfg = greedy_config(check, method)
            if method not in rows:
                rows[method] = {"cpu": cpu.generate(classes, dcfg, batch=2, tokens=tokens).tokens}
            pipe = check.pipe(mode, check.models, "fp32", **exact)
            rows[method][mode] = pipe.generate(classes, dcfg, batch=2, tokens=tokens).tokens


@contextlib.contextmanager
def ieee_fp32():
    """fp32 matrix products in IEEE fp32 inside the block (TF32 is process-wide in torch, and runners prepared
    earlier, by the conformance kit say, switched it on)."""
    matmul = torch.backends.cuda.matmul
    before, matmul.allow_tf32 = matmul.allow_tf32, False
    try:
        yield
    finally:
        matmul.allow_tf32 = before


def first_difference(a: torch.Tensor, b: torch.Tensor) -> Optional[int]:
    """The first token position where any image differs, or None."""
    diff = (a != b).any(0).nonzero()
    return int(diff[0]) if len(diff) else None


# ---- sync -----------------------------------------------------------------------------------------------------
def calling_site() -> str:
    """The project's innermost frame on the stack (outside this tool), as `path:line (function)`: where lantern
    asked for what is being counted."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(ROOT) and path != Path(__file__).resolve():
            return f"{path.relative_to(ROOT)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "outside the project"


class HostReads(torch.overrides.TorchFunctionMode):
    """CPU stand-in for CUDA's sync debug mode: counts the calls that would read a device tensor on the host, by
    calling site (here every tensor is a host tensor, so reads of what is on the host on CUDA count too)."""

    CALLS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.CALLS and args and isinstance(args[0], torch.Tensor):
            self.sites[calling_site()] += 1
        return func(*args, **(kwargs or {}))


def count_syncs(quick: bool, run: Callable[[], object]) -> collections.Counter[str]:
    """Synchronisations while `run()` runs, by calling site: torch.cuda.set_sync_debug_mode's warnings (each
    site read off the stack as the warning is shown), or host reads (--quick)."""
    if quick:
        with HostReads() as reads:
            run()
        return reads.sites
    sites: collections.Counter[str] = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[calling_site()] += 1
    with warnings.catch_warnings():  # restores showwarning after
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def syncs(check: Check) -> dict:
    out = {}
    for method in ("ar", "lantern++"):
        if not check.budget.allows(10):
            check.skip(f"sync {method}", "budget")
            continue
        dcfg = greedy_config(check, method)
        pipe = check.pipe("fused", check.models, "fp32", **({} if check.quick else {"tf32": False}))
        pipe.generate([0, 1], dcfg, batch=2, tokens=check.args.parity_tokens)  # compiled (parity did, if it ran)
        box = {}
        sites = count_syncs(check.quick, lambda: box.setdefault("r", pipe.generate([2, 3], dcfg, batch=2,
                                                                                   tokens=check.args.sync_tokens)))
        n, steps = sum(sites.values()), max(image["target_forwards"]
                                            for image in box["r"].stats.summary()["per_image"])
        out[method] = {"syncs": n, "steps": steps, "beyond_one_per_step": n - steps,
                       "sites": dict(sites.most_common()), "tokens": box["r"].stats.tokens,
                       "how": "host reads (stand-in)" if check.quick else "torch.cuda.set_sync_debug_mode warnings"}
    return out


# ---- cold -----------------------------------------------------------------------------------------------------
COLD_RUNS = {"cold_machine": "empty caches", "warm_caches": "warm caches", "default": "warm caches"}  # in run order


def cold_start(check: Check) -> dict:
    """What a user's fresh `lantern generate` process pays for its first image, measured on real processes: the
    first timing shape saved as a bundle; AR on the fused step with empty compile caches (inductor's, Triton's
    and lantern's, as on a new machine), then again with the caches the first process left, then the default
    (no --backend, --method or --dtype) with them. Processes only: the parent's CUDA state is left as it is."""
    from bench_serve import lantern_command, lantern_env
    if not check.budget.allows(COLD_SECTION_S):
        check.skip("cold start", "budget")
        return {}
    fused = check.modes["fused"]
    named = ["--backend", fused.backend, *(["--fused-step"] if fused.options.get("fused_step") else []),
             "--method", "ar", "--dtype", check.args.dtype]
    shape, make = next(iter(shapes(check).items()))
    # a process killed at its timeout may leave compile workers writing into its caches for a moment
    with tempfile.TemporaryDirectory(prefix="lantern-cold-", ignore_cleanup_errors=True) as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        models = make()
        bundle = save_as_bundle(check, shape, models, tmp / "bundle")
        out = {"shape": shape, "parameters": models.parameters, "bundle_s": time.perf_counter() - t0,
               "goal_first_image_s": GOAL_FIRST_IMAGE_S, "runs": {}}
        del models
        caches = {name: tmp / name for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "LANTERN_CACHE_DIR")}
        for folder in caches.values():
            folder.mkdir()
        env = lantern_env(**{name: str(folder) for name, folder in caches.items()}, **compiler_env(fused))
        for run, caches_were in COLD_RUNS.items():
            if not check.budget.allows(GOAL_FIRST_IMAGE_S):
                check.skip(f"cold {run}", "budget")
                continue
            flags = [] if run == "default" else named
            left = check.budget.overall_left()  # started within the share, it may run on to the check's end (the
            # default measures its acceptance records and calibration first); no budget (--quick): until it exits
            timeout = max(left, 2 * GOAL_FIRST_IMAGE_S) if math.isfinite(left) else None
            row = generate_process(lantern_command("generate", "--model", str(bundle), *flags, "--classes", "0",
                                                   "--seed", "0", "--out", str(tmp / f"out-{run}"), "--json"),
                                   env, timeout)
            out["runs"][run] = {"flags": " ".join(flags) or "default", "caches": caches_were, **row}
            if row.get("timed_out"):
                check.skip(f"cold {run}", f"timed out after {timeout:.0f} s")  # only with a timeout
    return out


def save_as_bundle(check: Check, shape: str, models, folder: Path) -> Path:
    """Inflated models as a bundle folder `lantern generate --model` loads, written by `lantern import`'s writer
    (so at LlamaGen's class-to-image sampling): their config, with the norms' epsilon inflation rescaled (which
    the config alone does not say), and the embedded model's VQ decoder at their vocabulary and grid (its codebook
    cut, or padded with zero codes, which the padded logits never sample)."""
    from lantern.bundle.from_llamagen import ImportRequest, Imported, write_bundle
    cfg = dataclasses.replace(models.target.config, norm_eps=models.target.norm.eps)
    vq = check.bundle.vq
    vq_cfg = dataclasses.replace(vq.config, codebook_size=cfg.vocab_size,
                                 image_size=cfg.grid_size * vq.config.downsample)
    vq_state = vq.state_dict()
    codebook = torch.zeros(cfg.vocab_size, vq_cfg.codebook_embed_dim)
    kept = min(cfg.vocab_size, vq.config.codebook_size)
    codebook[:kept] = vq_state["quantize.embedding.weight"][:kept]
    inflated = "--quick's tiny model" if check.quick else "the embedded model"
    request = ImportRequest(gpt=check.bundle.path / "target.safetensors", vq=check.bundle.path / "vq.safetensors",
                            out=folder, command=f"tools/gpu_check.py cold: {inflated} inflated to {shape}")
    return write_bundle(request, Imported(cfg, shape, models.target.state_dict(), vq_cfg,
                                          {**vq_state, "quantize.embedding.weight": codebook}, [], models.drafter,
                                          models.proximity))


def compiler_env(mode: Mode) -> dict[str, str]:
    """The environment that gives a `lantern` process the mode's compiler, which no flag names: --quick's dynamo
    eager compiler for every graph of cpu-graph (torch's TORCH_COMPILE_OVERRIDE_BACKENDS)."""
    compiler = mode.options.get("compiler")
    return {"TORCH_COMPILE_OVERRIDE_BACKENDS": f">=0:{compiler}"} if compiler else {}


def generate_process(command: list[str], env: dict, timeout: Optional[float]) -> dict:
    """One `lantern generate --json` process: seconds from its spawn to its exit and to its first image on disk
    (the PNG's mtime), what its JSON says it ran and spent; or its exit code and the tails of its output."""
    spawned, t0 = time.time(), time.perf_counter()
    try:  # timeout None: as long as it runs
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # its output so far, in bytes whatever `text` asked
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        return {"timed_out": True, "exit_code": None, "wall_s": time.perf_counter() - t0, "stderr_tail": err[-2000:]}
    row = {"exit_code": done.returncode, "wall_s": time.perf_counter() - t0}
    if done.returncode != 0:  # --json prints its error on stdout
        return {**row, "stdout_tail": done.stdout[-1000:], "stderr_tail": done.stderr[-2000:]}
    result = json.loads(done.stdout)
    first_image_s = Path(result["image_paths"][0]).stat().st_mtime - spawned
    return {**row, "first_image_s": first_image_s, "meets_goal": first_image_s <= GOAL_FIRST_IMAGE_S,
            "decode_s": result["wall_seconds"], "warmup_s": result["warmup_seconds"], "backend": result["backend"],
            "dtype": result["dtype"], "method": result["mode"], "decode": result["decode"], "plan": result["plan"]}


# ---- distribution ---------------------------------------------------------------------------------------------
def distribution(check: Check) -> dict:
    """The lossless Jacobi methods (MC-SJD, MC-SJD-PAC) against AR on the eager device mode: each token position's
    marginal, chi-square."""
    from scipy.stats import chi2_contingency
    from lantern.decoding import SamplingConfig, method_preset
    n, tokens, width = (128, 3, 32) if check.quick else (1024, 4, 64)
    sampling = SamplingConfig(**check.bundle.default_sampling)
    pipe = check.pipe("eager", check.models, "fp32")
    draws = {}
    for seed, method in ((1, "ar"), (2, "mc-sjd"), (3, "mc-sjd-pac")):
        draws[method] = pipe.generate([0] * n, method_preset(method, sampling), seed=seed, batch=width,
                                      tokens=tokens).tokens.cpu()
    methods = {}
    for method in ("mc-sjd", "mc-sjd-pac"):
        pvalues = []
        for t in range(tokens):
            codes = sorted(set(draws["ar"][:, t].tolist()) | set(draws[method][:, t].tolist()))
            table = [[int((draws[m][:, t] == c).sum()) for c in codes] for m in ("ar", method)]
            pvalues.append(float(chi2_contingency(table)[1]) if len(codes) > 1 else 1.0)
        p = min(1.0, min(pvalues) * len(pvalues))  # Bonferroni over positions
        methods[method] = {"p_value": p, "p_by_position": pvalues, "passed": p > 1e-3}
    return {"methods": methods, "against": "ar", "images": n, "tokens": tokens, "sampling": sampling.__dict__,
            "passed": all(m["passed"] for m in methods.values())}


# ---- timing ---------------------------------------------------------------------------------------------------
def shapes(check: Check) -> dict:
    """Shape name -> inflated models: GPT-B and GPT-L, or (--quick) the embedded model slightly inflated."""
    from lantern.models.inflate import inflate_models, inflated_config
    m = check.models
    if check.quick:
        cfg = m.target.config
        tiny = inflated_config(cfg, cfg.dim + cfg.head_dim, cfg.n_layer, cfg.vocab_size + 16, cfg.multiple_of)
        return {"tiny": lambda: inflate_models(m.target, m.drafter, m.proximity, tiny)}
    return {s: (lambda s=s: inflate_models(m.target, m.drafter, m.proximity, s)) for s in check.args.shapes}


def samplings(check: Check) -> dict:
    return sampling_settings(check.bundle.default_sampling)


def timing(check: Check, images: list[int]) -> list[dict]:
    check.drop_pipes(check.models)  # the correctness sections' runners (1024 images' caches): not in any row's peak
    rows = check.record["sections"].setdefault("timing", {"rows": []})["rows"]
    for shape, make in shapes(check).items():
        groups = [(n, name) for n in images for name in samplings(check)]
        kept = {group: earlier_group(check, shape, *group) for group in groups}
        for (n, name), earlier_rows in kept.items():
            if earlier_rows:
                rows.extend(earlier_rows)
                print(f"[gpu_check] timing {shape} {name} B={n}: kept from commit {earlier_rows[0]['commit']}",
                      file=sys.stderr)
        if all(kept.values()):
            continue
        if not check.budget.allows(30):
            check.skip(f"timing {shape} {images}", "budget")
            continue
        models = make()
        check.record["sections"]["timing"].setdefault("shapes", {})[shape] = describe_shape(models)
        for n in images:
            for name, sampling in samplings(check).items():
                if not kept[(n, name)]:
                    timing_rows(check, models, shape, name, sampling, n, rows)
                    check.save()
        check.drop_pipes(models)
        del models
    return rows


def describe_shape(models) -> dict:
    cfg = models.target.config
    return {"dim": cfg.dim, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "vocab_size": cfg.vocab_size,
            "parameters": models.parameters}


def timing_rows(check: Check, models, shape: str, sampling_name: str, sampling, n: int, rows: list) -> None:
    """AR on every mode, then each method on --method-mode, then auto: one generation each after its prepare."""
    classes = [i % models.target.config.num_classes for i in range(n)]
    base = dict(shape=shape, sampling=sampling_name, images=n, dtype=check.args.dtype,
                commit=check.record["sections"]["env"]["commit"])
    ar, ar_step_ms = {}, {}
    plan = [(mode, "ar") for mode in ("fused", "graph", "eager")]
    plan += [(check.args.method_mode, m) for m in SPEED_METHODS]  # planned_rows, in this order
    for mode, method in plan:
        what = f"timing {shape} {sampling_name} B={n} {method} on {mode}"
        if not check.budget.allows(10 if mode == "eager" else COLD_COMPILE_S):
            check.skip(what, "budget")
            continue
        try:
            row = timing_row(check, models, mode, method, sampling, classes)
        except Exception as e:  # noqa: BLE001  a row that breaks is a finding; the other rows still run
            check.error(what, e)
            continue
        row = {**base, **row}
        if method == "ar":
            ar[mode], ar_step_ms[mode] = row["wall_s"], row["step_ms"]
        rows.append(row)
    if ar:
        fastest = min(ar, key=ar.get)
        mine = [r for r in rows if (r["shape"], r["images"], r["sampling"]) == (shape, n, sampling_name)
                and "verify_width" in r]
        ratios = verify_cost_ratios(check, models, {r["verify_width"] for r in mine}, n, sampling)
        for row in mine:
            finish_row(row, fastest, ar[fastest], ratios, ar_step_ms[fastest])
        check.save()  # the group's timings first: a profile that breaks the device must not cost them
        if n == 1 and sampling_name == "bundle" and check.args.step_profiles:
            profile_fused_rows(check, models, sampling, classes, [r for r in mine if r["mode"] == "fused"])
    if sampling_name == "bundle":
        try:
            auto_row(check, models, base, classes, rows, ar, sampling)
        except Exception as e:  # noqa: BLE001
            check.error(f"timing {shape} B={n} auto", e)


def planned_rows(check: Check) -> set[tuple[str, str]]:
    """(mode, method) of every row a timing group times: AR on every mode, each method on --method-mode."""
    return {(mode, "ar") for mode in ("fused", "graph", "eager")} | {
        (check.args.method_mode, m) for m in SPEED_METHODS}


def earlier_group(check: Check, shape: str, n: int, sampling_name: str) -> list[dict]:
    """With --resume: a timing group (shape, images, sampling) an earlier run completed (every planned row, each
    against the fastest AR of that same run), its rows as they were (each names its commit); else []. A group
    is kept or timed whole, so a ratio never mixes runs."""
    if check.earlier is None:
        return []
    group = [r for r in check.earlier["sections"].get("timing", {}).get("rows", [])
             if (r["shape"], r["images"], r["sampling"]) == (shape, n, sampling_name)]
    complete = planned_rows(check) <= {(r["mode"], r["method"]) for r in group if r.get("fastest_ar")}
    commit = check.earlier["sections"]["env"]["commit"]
    return [{"commit": commit, **r} for r in group] if complete else []


def earlier_section(check: Check, section: str) -> Optional[dict]:
    """With --resume: a section an earlier run of this same commit finished (no error, nothing skipped), else
    None."""
    e = check.earlier
    if e is None or e["sections"].get("env", {}).get("commit") != check.record["sections"]["env"]["commit"]:
        return None
    result = e["sections"].get(section)
    finished = isinstance(result, dict) and "error" not in result and not any(
        x.startswith(f"{section} ") for x in e.get("skipped", []))
    return result if finished else None


def timing_row(check: Check, models, mode: str, method: str, sampling, classes: list) -> dict:
    """One method on one mode: prepared (compiled) untimed, then one whole generation timed."""
    from lantern.plan.calibration import compile_fused_step
    n, tokens, dtype = len(classes), check.args.tokens, check.args.dtype
    dcfg = method_config(check, method, sampling)
    pipe = check.pipe(mode, models, dtype)
    t0 = time.perf_counter()
    pipe.generate(classes, dcfg, batch=n, tokens=2)
    compile_fused_step(pipe, dcfg, n)
    prepare_s = time.perf_counter() - t0
    result = pipe.generate(classes, dcfg, seed=0, batch=n, tokens=tokens)
    s = result.stats.summary()
    return {"mode": mode, "backend": check.modes[mode].backend, "method": method, "wall_s": s["wall_seconds"],
            "tokens_per_forward": s["step_compression"], "prepare_s": prepare_s,
            "peak_memory_gib": result.profile["memory"]["peak_bytes"] / 2 ** 30,
            "verify_width": pipe.spec(dcfg, n).verify_widths[0],
            "step_ms": 1000 * s["wall_seconds"] * n / max(s["verify_steps"], 1)}  # the images step together


def profile_fused_rows(check: Check, models, sampling, classes: list, rows: list[dict]) -> None:
    for row in rows:
        what = f"step profile {row['shape']} B={row['images']} {row['method']}"
        if not check.budget.allows(10):
            check.skip(what, "budget")
            continue
        try:
            row["step_profile"] = step_profile(check, check.pipe("fused", models, check.args.dtype),
                                               method_config(check, row["method"], sampling), classes)
        except Exception as e:  # noqa: BLE001  the row's timing stands without its profile
            check.error(what, e)


def step_profile(check: Check, pipe, dcfg, classes: list, tokens: int = 32) -> dict:
    """Where one engine step's time goes, from torch.profiler over a short generation on the prepared runner: the
    device's kernels per step (inside the recorded graph), their busy time against the step's wall time (the rest
    is the gaps between kernels), and the costliest kernels. --quick: the host's ops instead."""
    from torch.profiler import ProfilerActivity, profile
    activity = ProfilerActivity.CPU if check.quick else ProfilerActivity.CUDA
    with profile(activities=[activity]) as prof:
        result = pipe.generate(classes, dcfg, seed=0, batch=len(classes), tokens=tokens)
    s = result.stats.summary()
    steps = max(s["verify_steps"] // len(classes), 1)
    kind = "cpu" if check.quick else "cuda"
    events = [(e.key, e.count, getattr(e, f"self_{'cpu' if check.quick else 'device'}_time_total"))
              for e in prof.key_averages() if str(e.device_type).lower().endswith(kind)]
    events = [e for e in events if e[2] > 0]
    top = sorted(events, key=lambda e: -e[2])[:8]
    return {"steps": steps, "wall_ms": 1000 * s["wall_seconds"] / steps,
            "busy_ms": sum(e[2] for e in events) / 1000 / steps, "kernels": sum(e[1] for e in events) / steps,
            "top": [{"name": name[:90], "per_step": count / steps, "ms": us / 1000 / steps} for name, count, us in top]}


def verify_cost_ratios(check: Check, models, widths: set[int], n: int, sampling) -> dict[str, dict[int, float]]:
    """Verify width -> its median target forward over AR's one-token forward, timed with the runner's phase timer
    (CUDA events) on the eager device mode two ways: as eager runs it ("eager": launch-bound at small shapes)
    and recorded once as a CUDA graph and replayed ("replayed": as a graph mode or the fused step runs it; not
    on --quick's CPU stand-ins)."""
    from lantern.backends import get_backend
    from lantern.profile.measure import step_spec, verify_latency
    if not check.budget.allows(10):
        return {}
    m = check.modes["eager"]
    backend = get_backend(m.backend, **m.options)
    rows = n * sampling.rows_per_image
    timings = {"eager": None} if check.quick else {"eager": None, "replayed": torch.cuda}  # how -> replay_on
    ratios = {}
    for how, replay_on in timings.items():
        try:
            median = {w: verify_latency(backend, models.target,
                                        step_spec(models.target.config, rows, check.args.dtype, w), warmup=2,
                                        repeats=5, replay_on=replay_on)["latency"]["median_s"]
                      for w in sorted(widths | {1})}
        except Exception as e:  # noqa: BLE001  a forward that cannot be recorded is a finding; eager's ratio stands
            check.error(f"verify cost ratio {how} B={n}", e)
            continue
        ratios[how] = {w: median[w] / median[1] for w in widths}
    return ratios


def finish_row(row: dict, fastest: str, fastest_s: float, ratios: dict[str, dict[int, float]],
               ar_step_ms: float) -> None:
    """The row against the fastest AR of its group: speed-up, ceiling, and where a step's time goes: its target
    forward (the verify cost ratio times the fastest AR's step) and the rest (drafting, sampling, acceptance).
    A graph or fused row's ratio is the replayed one where there is one (its forward is replayed too)."""
    how = "replayed" if row["mode"] != "eager" and "replayed" in ratios else "eager"
    ratio = ratios.get(how, {}).get(row["verify_width"])
    ceiling = row["tokens_per_forward"] / ratio if ratio else None
    speedup = fastest_s / row["wall_s"]
    forward_ms = ratio * ar_step_ms if ratio else None
    row.update(fastest_ar=fastest, speedup_vs_fastest_ar=speedup, verify_cost_ratio=ratio, ratio_timed=how,
               verify_cost_ratios={k: v.get(row["verify_width"]) for k, v in ratios.items()}, ceiling=ceiling,
               of_ceiling=speedup / ceiling if ceiling else None, forward_ms=forward_ms,
               beyond_forward_ms=row["step_ms"] - forward_ms if ratio else None)


def auto_row(check: Check, models, base: dict, classes: list, rows: list, ar: dict, sampling) -> None:
    """The default on a calibrated machine: every mode calibrated for this request size first, as `lantern profile
    calibrate` does (untimed, its seconds reported: `calibrate_s`), then `--method auto`, no backend pinned, at the
    bundle's sampling and relaxation settings and (on a GPU: inflation keeps the tokens) its acceptance records,
    its chosen runner warmed, then one generation timed. (A first request on an uncalibrated machine measures only
    what its share of deciding pays for: the cold section's `default` process.)"""
    from lantern.api import ModelDefaults, Pipeline
    from lantern.plan.backend_choice import choose_backend
    if base["images"] not in (1, 16) or not check.budget.allows(AUTO_CALIBRATE_S):
        check.skip(f"auto {base['shape']} B={base['images']}", "budget" if base["images"] in (1, 16) else
                   "auto runs at 1 and 16 images")
        return
    b = check.bundle
    defaults = ModelDefaults(sampling, b.validations, {} if check.quick else b.acceptance_records)
    pipe = Pipeline(models.target, models.drafter, models.proximity, defaults=defaults)
    n = len(classes)
    t0 = time.perf_counter()
    choose_backend(pipe.sibling, n, sampling, progress=False, classes=classes, dtype=pipe.dtype, default=pipe,
                   calibrate_all=True)
    calibrate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pipe.generate(classes, "auto", batch=n, tokens=2)
    prepare_s = time.perf_counter() - t0
    result = pipe.generate(classes, "auto", seed=0, batch=n, tokens=check.args.tokens)
    fastest = min(ar, key=ar.get) if ar else None
    plan = result.plan.to_dict() if result.plan is not None else {}
    rows.append({**base, "mode": "auto", "backend": result.backend, "method": f"auto ({plan.get('method')})",
                 "plan": plan, "calibrate_s": calibrate_s,
                 "wall_s": result.stats.wall_seconds, "tokens_per_forward": result.stats.step_compression,
                 "prepare_s": prepare_s, "peak_memory_gib": result.profile["memory"]["peak_bytes"] / 2 ** 30,
                 "fastest_ar": fastest, "speedup_vs_fastest_ar": ar[fastest] / result.stats.wall_seconds
                 if fastest else None})
    pipe.release()


# ---- serve ----------------------------------------------------------------------------------------------------
def serve(check: Check) -> dict:
    """The service under `clients` closed-loop clients for --serve-s seconds, against one `lantern generate`
    process per image (each client one image in turn, for the same seconds)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_serve import LogDrain, lantern_command, num_classes, summary
    import httpx
    clients, seconds, classes = check.args.clients, check.args.serve_s, num_classes(check.args.model)
    model = ["--model", check.args.model] if check.args.model else []
    backend = check.modes["eager"].backend
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(lantern_command("serve", *model, "--backend", backend, "--method", check.args.serve_method,
                                            "--batch", str(clients), "--queue", str(clients), "--max-n", "1",
                                            "--port", "0"), stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = json.loads(proc.stderr.readline())["url"]
        drain = LogDrain(proc.stderr)  # a log line per request: undrained, the pipe fills and the service blocks
        ready = wait_ready(httpx, url, proc, drain, check.budget.left())
        if ready is None:
            return {"error": "the service was not ready within the budget"}

        async def service_client(c, request):
            r = await c.post(f"{url}/v1/images/generations", json={"class_id": request % classes,
                                                                      "seed": 1000 + request})
            r.raise_for_status()

        async def run_service():
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as c:
                await closed_loop_for(clients, 1.0, lambda k: service_client(c, k))  # untimed warm-up
                return await closed_loop_for(clients, seconds, lambda k: service_client(c, k))
        service = asyncio.run(run_service())
    finally:
        proc.terminate()
        proc.wait(60)
    out = {"backend": backend, "method": check.args.serve_method, "clients": clients, "seconds": seconds,
           "served": {k: ready.get(k) for k in ("backend", "fused_step", "dtype", "widths", "plan")},
           "service": summary(*service)}
    if check.budget.overall_left() > 2 * BASELINE_S:
        with tempfile.TemporaryDirectory() as tmp:
            async def one_process(k):
                p = await asyncio.create_subprocess_exec(
                    *lantern_command("generate", *model, "--backend", backend, "--classes", str(k % classes), "--seed",
                                     str(1000 + k), "--method", check.args.serve_method, "--batch", "1", "--out",
                                     str(Path(tmp) / str(k))), stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE, env=env)
                _, err = await p.communicate()
                if p.returncode != 0:
                    raise RuntimeError(f"lantern generate exited {p.returncode}: {err.decode()[-400:]}")
            if check.args.serve_method == "auto":  # untimed: what a first process makes once (auto's calibration)
                asyncio.run(one_process(0))
            out["one_process_per_image"] = summary(*asyncio.run(closed_loop_for(clients, min(seconds, BASELINE_S),
                                                                                one_process)))
        out["service_over_processes"] = (out["service"]["images_per_s"]
                                         / out["one_process_per_image"]["images_per_s"])
    else:
        check.skip("serve: one process per image", "budget")
    return out


def wait_ready(httpx, url: str, proc, drain, seconds: float) -> Optional[dict]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/ready", timeout=10)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"lantern serve exited with {proc.returncode}: {drain.tail()}")
        time.sleep(1.0)
    return None


async def closed_loop_for(clients: int, seconds: float, send) -> tuple[list[float], int, float]:
    """`clients` clients, each sending its next request when its last one is answered, until `seconds` have
    passed (requests under way then are waited for and counted; each client sends one at least, however late it
    starts on a busy machine). Returns (latencies, images, seconds)."""
    latencies, end, counter = [], time.monotonic() + seconds, iter(range(10 ** 9))

    async def client():
        while True:
            t = time.perf_counter()
            await send(next(counter))
            latencies.append(time.perf_counter() - t)
            if time.monotonic() >= end:
                return

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, len(latencies), time.perf_counter() - t0


# ---- results --------------------------------------------------------------------------------------------------
def write_all(stem: Path, record: dict) -> None:
    """<stem>.json, .md and .png, written whole each time; copied under $OUT where that is set."""
    from lantern.files import atomic_io
    stem.parent.mkdir(parents=True, exist_ok=True)
    atomic_io.write_text(stem.with_suffix(".json"), json.dumps(record, indent=2, default=str))
    atomic_io.write_text(stem.with_suffix(".md"), markdown(record))
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    if record["sections"].get("timing", {}).get("rows"):
        plot(record, stem.with_suffix(".png"))
        paths.append(stem.with_suffix(".png"))
    out = os.environ.get("OUT")
    if out:
        for p in paths:
            if p.parent.resolve() != Path(out).resolve():  # --out under $OUT: written there already
                shutil.copy(p, Path(out) / p.name)


def fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def summary_lines(record: dict) -> list[str]:
    """The short table: one line per check, one per timing row."""
    s = {k: v for k, v in record["sections"].items() if not (isinstance(v, dict) and "error" in v)}
    lines = [f"{k}: ERROR {v['error']}" for k, v in record["sections"].items() if isinstance(v, dict) and "error" in v]
    lines += [f"backend {name}: {state}" for name, state in s.get("env", {}).get("backends", {}).items()
              if name.startswith("onnx")]
    for name, r in s.get("conformance", {}).items():
        lines.append(f"conformance {name}: {'pass' if r['passed'] else 'FAIL ' + str(r['failures'][:2])}")
    for method, by_mode in s.get("parity", {}).get("methods", {}).items():
        lines.append(f"greedy parity {method}: " + ", ".join(
            f"{mode} {'=' if v['equal'] else '!= from token ' + str(v['first_difference'])}"
            for mode, v in by_mode.items()))
    for method, r in s.get("sync", {}).items():
        lines.append(f"sync fused {method}: {r['syncs']} syncs over {r['steps']} steps "
                     f"({r['beyond_one_per_step']} beyond one per step)")
        lines += [f"  {count} at {site}" for site, count in r.get("sites", {}).items()]
    lines += cold_lines(s.get("cold", {}))
    if "distribution" in s:
        d = s["distribution"]
        by_method = d.get("methods") or {d["method"]: d}  # a record of before mc-sjd-pac held MC-SJD's alone
        lines += [f"distribution {method} vs {d['against']}: p = {r['p_value']:.3g} "
                  f"({'pass' if r['passed'] else 'FAIL'})" for method, r in by_method.items()]
    commit = s.get("env", {}).get("commit")
    for r in record["sections"].get("timing", {}).get("rows", []):
        lines.append(f"{r['shape']} {r['sampling']} B={r['images']} {r['method']:<16} {r['mode']:<6} "
                     f"{r['wall_s']:.3f} s  x{fmt(r.get('speedup_vs_fastest_ar'))} vs {r.get('fastest_ar')} AR  "
                     f"tok/fwd {r['tokens_per_forward']:.2f}  ratio {ratio_text(r)}  "
                     f"ceiling {fmt(r.get('ceiling'))}  step {fmt(r.get('step_ms'))} ms "
                     f"(beyond the forward {fmt(r.get('beyond_forward_ms'))})  peak {r['peak_memory_gib']:.2f} GiB"
                     + (f"  (commit {r['commit']})" if r.get("commit", commit) != commit else ""))
    for r in s.get("timing", {}).get("rows", []):
        p = r.get("step_profile")
        if p:
            lines.append(f"  profile {r['method']}: {p['kernels']:.0f} kernels/step, busy {p['busy_ms']:.3f} of "
                         f"{p['wall_ms']:.3f} ms; top: " + ", ".join(f"{t['name'][:40]} {t['ms']:.3f} ms"
                                                                    for t in p["top"][:3]))
    if "serve" in s and "service" in s["serve"]:
        v = s["serve"]
        lines.append(f"serve {v['clients']} clients {v['seconds']:.0f} s: {v['service']['images_per_s']:.2f} "
                     f"images/s, p99 {v['service']['p99_s']:.2f} s; one process per image "
                     f"{fmt(v.get('one_process_per_image', {}).get('images_per_s'))} images/s; "
                     f"ratio {fmt(v.get('service_over_processes'), '.1f', 'x')}")
    lines += [f"ERROR {x}" for x in record.get("errors", [])] + [f"skipped {x}" for x in record["skipped"]]
    return lines


def ratio_text(row: dict) -> str:
    """The row's verify cost ratio; a replayed one with its eager one after it."""
    if row.get("ratio_timed") != "replayed":
        return fmt(row.get("verify_cost_ratio"))
    return f"{fmt(row['verify_cost_ratio'])} (eager {fmt(row['verify_cost_ratios'].get('eager'))})"


def cold_lines(cold: dict) -> list[str]:
    """One line per cold process: its first image against the goal, its exit, and what the default chose."""
    lines = []
    for run in cold.get("runs", {}).values():
        head = f"cold {cold['shape']} {run['flags']}, {run['caches']}: "
        if run["exit_code"] != 0:
            ended = "timed out" if run.get("timed_out") else f"exit {run['exit_code']}"
            said = (run.get("stdout_tail") or run["stderr_tail"]).strip().splitlines() or [""]
            lines.append(head + f"{ended} after {run['wall_s']:.1f} s (goal {cold['goal_first_image_s']:.0f} s: "
                                f"FAIL): {said[-1][:200]}")
            continue
        plan = run["plan"] or {}
        chose = (f"chose {plan.get('plan')} on {run['backend']}{' fused' if plan.get('fused_step') else ''}, "
                 if run["flags"] == "default" else "")
        lines.append(head + f"{chose}first image {run['first_image_s']:.1f} s (goal "
                            f"{cold['goal_first_image_s']:.0f} s: {'pass' if run['meets_goal'] else 'FAIL'}), "
                            f"exit {run['wall_s']:.1f} s")
    return lines


def markdown(record: dict) -> str:
    env = record["sections"].get("env", {})
    head = [f"# lantern GPU check: {env.get('device')}", "",
            f"{env.get('date')}; driver {env.get('driver')}, CUDA {env.get('cuda')}, torch {env.get('torch')}; "
            f"commit {env.get('commit')}; `{env.get('command')}`; {budget_text(record['budget_s'])}, ran "
            f"{record.get('elapsed_s', 0):.0f} s.", ""]
    if record["quick"]:
        head += [f"**--quick: CPU stand-ins ({record['stand_ins']}), tiny shapes; the numbers mean nothing.**", ""]
    head += ["Timing rows: one generation after its prepare (compile); x = the fastest AR of the same row group "
             "(named) over this row; ratio = the method's verify forward over AR's one-token forward (CUDA events; "
             "on graph and fused rows the forward recorded as a CUDA graph and replayed, its eager ratio after it "
             "in brackets); ceiling = tokens per forward / ratio; of ceiling = x / ceiling. Cold rows: one new "
             "`lantern generate` process (one image) on the first timing shape saved as a bundle; first image = its "
             "spawn to the PNG on disk, exit = its spawn to its exit.", "", "```"]
    return "\n".join(head + summary_lines(record) + ["```", ""])


def budget_text(seconds: Optional[float]) -> str:
    return "no budget" if seconds is None else f"budget {seconds:.0f} s"


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in record["sections"]["timing"]["rows"] if r.get("speedup_vs_fastest_ar")]
    groups = sorted({(r["shape"], r["sampling"]) for r in rows})
    fig, axes = plt.subplots(1, max(len(groups), 1), figsize=(4.8 * max(len(groups), 1), 3.8), squeeze=False)
    for ax, (shape, sampling) in zip(axes[0], groups):
        mine = [r for r in rows if (r["shape"], r["sampling"]) == (shape, sampling)]
        for method, mode in sorted({(r["method"], r["mode"]) for r in mine}):
            pts = sorted((r["images"], r["speedup_vs_fastest_ar"]) for r in mine
                         if (r["method"], r["mode"]) == (method, mode))
            ax.plot(*zip(*pts), marker="o", label=f"{method} ({mode})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", title=f"{shape}, {sampling} sampling", xlabel="images (B)",
               ylabel="speed-up over the fastest AR")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------------------------
SECTIONS = ("conformance", "parity", "sync", "cold", "distribution", "timing", "serve")


def section_shares(names: list[str]) -> dict[str, Optional[float]]:
    """Each section's share of the budget among the sections that run (SHARES, the rest to the last one, which
    has the whole remainder): a run of one section has the whole budget."""
    rest = 1.0 - sum(SHARES.values())
    total = sum(SHARES.get(n, rest) for n in names)
    return {n: None if i == len(names) - 1 else SHARES.get(n, rest) / total for i, n in enumerate(names)}


def where_it_broke(e: Exception, frames: int = 8) -> list[str]:
    """The last frames of e's traceback, one line each: enough to find the bug from the results file alone."""
    summary = traceback.extract_tb(e.__traceback__)[-frames:]
    return [f"{f.filename.rsplit('/lantern/', 1)[-1]}:{f.lineno} {f.name}: {f.line}" for f in summary]


def forget_cuda_graph_recordings() -> None:
    """After a unit broke, possibly inside a CUDA graph recording: drop inductor's recorded graphs (they are
    recorded again when next called), so that one failure does not fail every later unit with a corrupt pool."""
    if torch.cuda.is_available():
        from torch._inductor import cudagraph_trees  # here: only a real GPU run records graphs
        cudagraph_trees.reset_cudagraph_trees()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The arguments, every one and every input checked (exit 2 naming what is wrong), with --quick's sizes in."""
    from lantern.decoding import METHODS
    from lantern.models.inflate import INFLATE_SHAPES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU stand-ins, tiny shapes: a check that the tool runs")
    ap.add_argument("--budget-s", type=float,
                    help="seconds the check may start work in (default 420; --quick: no budget, every unit runs)")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--shapes", nargs="+", default=["GPT-B", "GPT-L"], choices=sorted(INFLATE_SHAPES))
    ap.add_argument("--images", type=int, nargs="+", default=[1, 4, 16], help="images decoded together")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="timing dtype")
    ap.add_argument("--method-mode", default="fused", choices=["eager", "graph", "fused"],
                    help="the mode the methods are timed on (AR runs on all three)")
    ap.add_argument("--tokens", type=int, help="tokens per image in timing rows (default: the whole image)")
    ap.add_argument("--parity-tokens", type=int, default=64, help="tokens per image of the greedy parity runs")
    ap.add_argument("--compiled-methods", nargs="+", default=list(PARITY_ORDER), choices=PARITY_ORDER,
                    help="methods whose greedy parity also runs on cuda-graph and the fused step (compiles each)")
    ap.add_argument("--sync-tokens", type=int, help="tokens per image of the counted runs (default: whole images)")
    ap.add_argument("--serve-s", type=float, default=60.0, help="seconds of closed-loop load on the service")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--serve-method", default="auto", choices=("auto", *METHODS),
                    help="the method the service and the one-process baseline run (default auto)")
    ap.add_argument("--model", help="the bundle `lantern serve` and `lantern generate` load (default: the embedded "
                                    "model)")
    ap.add_argument("--out", help="output stem (default results/gpu-<device>; --quick: a temporary folder)")
    ap.add_argument("--no-step-profiles", dest="step_profiles", action="store_false",
                    help="skip the profile of each fused method's step (one image, the bundle's sampling)")
    ap.add_argument("--resume", action="store_true",
                    help="keep what the results file at the output stem finished: sections of this commit, and "
                         "whole timing groups (their rows name their commit); run the rest")
    args = ap.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        ap.error(f"no CUDA device (torch {torch.__version__}); --quick runs the check on CPU stand-ins")
    problems = input_problems(args, None if args.quick else default_stem(quick=False), os.environ)
    if problems:  # refused before any section: a typo must not cost a lease
        ap.error("\n  ".join(problems))
    if args.budget_s is None and not args.quick:
        args.budget_s = 420.0
    if args.quick:
        args.images, args.tokens, args.parity_tokens, args.sync_tokens = [1], 6, 6, 6
        args.compiled_methods = ["ar", "lantern++", "mc-sjd-relaxed"]  # no drafter, a tree, a window
        args.method_mode = "eager"  # the fused step is traced by parity and sync already
        args.serve_s, args.clients, args.serve_method = 1.0, 2, "ar"  # a request per client at least
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    check = Check(args, Path(args.out) if args.out is not None else default_stem(args.quick))
    check.record["sections"]["env"] = environment(check)
    if check.earlier is not None:
        check.record["earlier_runs"] = [*check.earlier.get("earlier_runs", []), check.earlier["sections"]["env"]]
    check.save()
    wanted = set(args.sections)
    steps = [("conformance", "conformance", lambda: conformance(check)),
             ("parity", "parity", lambda: parity(check)),
             ("sync", "sync", lambda: syncs(check)),
             ("cold", "cold", lambda: cold_start(check)),
             ("distribution", "distribution", lambda: distribution(check)),
             ("timing-1", "timing", lambda: timing(check, [n for n in args.images if n == 1])),
             ("serve", "serve", lambda: serve(check)),
             ("timing-rest", "timing", lambda: timing(check, [n for n in args.images if n != 1]))]
    steps = [step for step in steps if step[1] in wanted]
    shares = section_shares([share for share, _, _ in steps])
    for share, section, run in steps:
        kept = earlier_section(check, section) if section != "timing" else None
        if kept is not None:
            check.record["sections"][section] = kept
            print(f"[gpu_check] {section}: kept from the earlier run of this commit", file=sys.stderr)
            continue
        check.budget.section(None if args.quick else shares[share])
        t0 = time.monotonic()
        try:
            result = run()
        except Exception as e:  # noqa: BLE001  one section's failure is a result; the others still run
            result = {"error": f"{type(e).__name__}: {e}", "traceback": where_it_broke(e)}
            print(f"[gpu_check] {share} failed: {result['error']}", file=sys.stderr)
            forget_cuda_graph_recordings()
        if section != "timing":
            check.record["sections"][section] = result
        elif "error" in result:  # timing's rows are in the record already, row by row
            check.record["sections"]["timing"] = {**check.record["sections"].get("timing", {}), **result}
        check.record.setdefault("section_s", {})[share] = time.monotonic() - t0
        check.save()
    print("\n".join(summary_lines(check.record)))
    print(f"[gpu_check] results: {check.stem}.json / .md" + (" / .png" if check.stem.with_suffix('.png').exists()
                                                              else ""))
    return 1 if failed(check.record) else 0


def failed(record: dict) -> bool:
    """Whether any correctness section failed or broke, or a cold `lantern generate` process exited with an error
    (timing rows, and the cold processes' seconds against the goal, are measurements, not checks)."""
    s = record["sections"]
    return (bool(record.get("errors")) or any("error" in v for v in s.values() if isinstance(v, dict))
            or any(not r["passed"] for r in s.get("conformance", {}).values() if isinstance(r, dict) and "passed" in r)
            or any(not v["equal"] for by in s.get("parity", {}).get("methods", {}).values() for v in by.values())
            or any(r["exit_code"] not in (0, None) for r in s.get("cold", {}).get("runs", {}).values())
            or not s.get("distribution", {}).get("passed", True))


if __name__ == "__main__":
    sys.exit(main())
