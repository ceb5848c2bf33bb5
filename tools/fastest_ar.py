"""The baseline every benchmark compares against: the fastest plain AR on this machine, over the modes that run
here -- eager (`cpu`), compiled (`cpu-graph`), fused (`cpu-graph` with the whole step as one graph) and ONNX
Runtime (`onnx`, fp32 only) -- timed in the same run as the methods it is compared with, on the same images and
seeds. Preparing a mode's runner (compiling, exporting) is done before timing and reported apart; the baseline is
decode wall time, as every method's is."""
from __future__ import annotations

from lantern.api import Pipeline
from lantern.backends import backend_class, get_backend
from lantern.decoding import method_preset
from lantern.plan.calibration import compile_fused_step

# mode -> (CPU backend, its options)
MODES = {"eager": ("cpu", {}), "compiled": ("cpu-graph", {}), "fused": ("cpu-graph", {"fused_step": True}),
         "onnx": ("onnx", {})}


def mode_pipeline(mode: str, target, drafter, proximity, dtype: str) -> Pipeline:
    backend, options = MODES[mode]
    return Pipeline(target, drafter, proximity, backend=backend, dtype=dtype, **options)


def prepare(pipe: Pipeline, dcfg, conditions: list, width: int) -> None:
    """The runner for (dcfg, width) prepared (compiled, exported) and, for a fused step, its step compiled, so
    that no timed run pays either."""
    pipe.generate(conditions, dcfg, batch=width, tokens=2)
    compile_fused_step(pipe, dcfg, width)


def runnable_modes(dtype: str, wanted: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The modes (of `wanted`, default all) that run `dtype` here, and why each other one does not."""
    ok, why = [], {}
    for mode in wanted or list(MODES):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
        backend, options = MODES[mode]
        avail = backend_class(backend).availability()
        if not avail.ok:
            why[mode] = f"unavailable: {avail.reason}"
        elif dtype not in get_backend(backend, **options).capabilities().dtypes:
            why[mode] = f"unavailable: no {dtype}"
        else:
            ok.append(mode)
    return ok, why


class ARBaseline:
    """AR on every runnable mode for one (models, dtype, batch width) setting; `time` runs each mode once on the
    same images and seed."""

    def __init__(self, target, drafter, proximity, dtype: str, sampling, modes: list[str], width: int = 1):
        self.dcfg, self.width = method_preset("ar", sampling), width
        self.pipes = {m: mode_pipeline(m, target, drafter, proximity, dtype) for m in modes}
        self.walls: dict[str, list[float]] = {m: [] for m in modes}
        self.prepare_s = {}
        for m, pipe in self.pipes.items():  # compile / export before any timing
            prepare(pipe, self.dcfg, [0] * width, width)
            self.prepare_s[m] = sum(pipe.prepare_seconds.values())

    def time(self, classes: list[int], seed: int, tokens: int | None = None) -> None:
        for m, pipe in self.pipes.items():
            result = pipe.generate(classes, self.dcfg, seed=seed, batch=self.width, tokens=tokens)
            self.walls[m].append(result.stats.wall_seconds)

    def fastest(self) -> dict:
        """The mode whose AR took the least in total over the same runs: {"mode", "backend", "total_s",
        "walls", "total_by_mode", "prepare_s"}."""
        totals = {m: sum(w) for m, w in self.walls.items() if w}
        best = min(totals, key=totals.get)
        return {"mode": best, "backend": MODES[best][0], "total_s": totals[best], "walls": self.walls[best],
                "total_by_mode": totals, "prepare_s": self.prepare_s}


def provenance() -> dict:
    """What a results file's tables name: the CPU, the commit and the command (write_results also stores the full
    record, lantern.backends.environment.provenance, under "provenance")."""
    from lantern.backends.environment import cpu_description, provenance as full
    made = full()
    return {"cpu": cpu_description(), "commit": made["commit"] or "unknown", "command": made["command"]}
