"""`--method auto` across backends and modes (lantern.plan.backend_choice), against the fastest AR, with one-time
compile costs counted; and the first-run probe that bounds a cold machine's deciding work (lantern.plan.choose)."""
import dataclasses
import json
import math
import statistics
from types import SimpleNamespace

import pytest
import torch._dynamo

from conftest import make_models
from lantern.backends import registry
from lantern.backends.torch_eager import CPUBackend
from lantern.models.config import GPTConfig

from lantern.api import ModelDefaults, Pipeline
from lantern.files.atomic_io import write_json
from lantern.decoding.sampling import SamplingConfig
from lantern.plan import backend_choice, calibration, choose as choose_mod, deciding
from lantern.decoding import method_preset
from lantern.plan.backend_choice import (FUSED, PRIOR_PREPARE_S, backend_of, candidate_backends, choose_backend,
                                         ledger_path, mode_row, pinned_backend, prepare_cost, record_prepared)
from lantern.plan.candidates import AR, RELAXED_METHODS, candidate_plans
from lantern.plan.choose import choose

SAMPLING = SamplingConfig(temperature=1.0, top_k=5, cfg_scale=2.0)


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("auto-backends-cache")


@pytest.fixture
def cache(module_cache, monkeypatch):
    """A cache shared by this module's tests (the tiny model's acceptance record is measured once), without
    calibrations or prepare ledgers at the start of each test."""
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(module_cache))
    # these tests pin the cost model and the modes, not the disturbance check (tests/cli/test_faults.py pins it): the
    # tiny model's sub-millisecond steps under the parallel suite's load would read as disturbed at random
    monkeypatch.setattr(calibration, "disturbance", lambda entry: "")
    for kind in ("calibration", "prepare"):
        for f in (module_cache / kind).glob("*.json"):
            f.unlink()
    return module_cache


class TwinBackend(CPUBackend):
    """The eager CPU backend under another name: a second mode whose calibration this test can afford. It takes
    fused_step as graph backends do (a LABELLED FAKE of a fused mode: its runners stay eager ones; these tests
    pin the planner's costs, not graphs)."""

    name = "cpu-twin"
    abilities = dataclasses.replace(CPUBackend.abilities, preparation="compile", fused_step=True)  # declared so

    def __init__(self, threads: int | None = None, fused_step: bool = False):
        super().__init__(threads)
        self.fused_step = fused_step


def make_pipe_factory(models):
    target, drafter, proximity = models
    made = {}

    def make(name, dtype, **options):
        key = (name, dtype, tuple(sorted(options.items())))
        if key not in made:
            pipe = Pipeline(target, drafter, proximity, backend="cpu" if name == TwinBackend.name else name,
                            dtype=dtype, defaults=ModelDefaults(sampling=SAMPLING),
                            **({} if name == TwinBackend.name else options))
            if name == TwinBackend.name:
                pipe.backend = TwinBackend(**options)
            made[key] = pipe
        return made[key]
    return make


def seed(pipe, width: int, step_ms: dict, fixed_s: float = 0.0, prepare_s: dict | None = None,
         candidate: str | None = None, sampling: SamplingConfig = SAMPLING) -> None:
    """A synthetic calibration (made by the test) for this pipeline's backend (or the candidate mode named) at
    `sampling`: the plans named in step_ms only; prepare_s: what preparing each plan again costs (the ledger)."""
    key = calibration.calibration_key(candidate or pipe.backend.name, pipe.dtype, pipe.model_key, sampling,
                                      pipe.config.vocab_size)
    plans = {name: {"step_s": ms / 1e3} for name, ms in step_ms.items()}
    calibration.save_calibration({"key": key, "widths": {str(width): {"fixed_s": fixed_s, "plans": plans}}})
    if prepare_s is not None:
        write_ledger(key, width, prepare_s)


def write_ledger(key: dict, width: int, prepare_s: dict, first_s: dict | None = None,
                 step_ms: dict | None = None) -> None:
    """A synthetic prepare ledger (made by the test): prepare_s, what preparing each plan again here took (one
    repeated preparation each); first_s, plans prepared once only (their first preparation's seconds); step_ms,
    the seconds per step of each plan's runs (`ran`, a list per plan)."""
    first_s = first_s or {}
    ledger = {"key": key, "widths": {str(width): {**prepare_s, **first_s}},
              "again": {str(width): {name: [s] for name, s in prepare_s.items()}}}
    if step_ms:
        ledger["ran"] = {str(width): {name: [ms / 1e3 for ms in runs] for name, runs in step_ms.items()}}
    write_json(ledger_path(key), ledger)


FREE = {"ar": 0.0, "mc-sjd/L4": 0.0}  # eager runners' last preparation, negligible


def everything(ms: float) -> dict:
    return {p.name: ms for p in candidate_plans(True, True, {m: {} for m in RELAXED_METHODS})}


@pytest.fixture
def two_modes(monkeypatch):
    """This machine runs eager and a compiled mode (the eager backend under another name, so choosing it compiles
    nothing; ONNX left out, whether installed or not)."""
    out = [{"backend": "onnx", "mode": "onnx", "status": "unavailable: left out by the test"}]
    monkeypatch.setitem(registry.BUILTIN, TwinBackend.name, f"{__name__}:TwinBackend")  # its modes: as declared
    monkeypatch.setattr(backend_choice, "candidate_backends",
                        lambda dtype=None: (["cpu", TwinBackend.name], out, dtype or "fp32"))


@pytest.mark.usefixtures("unlimited_deciding")
def test_compile_cost_decides_between_eager_and_compiled(cache, tiny, two_modes):
    make = make_pipe_factory(tiny)
    eager, compiled = make("cpu", "fp32"), make(TwinBackend.name, "fp32")
    # compiled steps cost a fifth of eager ones; Jacobi L=4 half of AR on both
    seed(eager, 1, {**everything(1000.0), "ar": 1.0, "mc-sjd/L4": 0.5}, prepare_s=FREE)
    seed(compiled, 1, {"ar": 0.2, "mc-sjd/L4": 0.1}, prepare_s={"ar": 100.0, "mc-sjd/L4": 100.0})
    slow_compile = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    # 100 s of compile swamps any step saving: eager, and the fastest AR is eager's (prepare counted)
    assert slow_compile.backend == "cpu" and slow_compile.mode == "eager"
    assert slow_compile.plan.name == "mc-sjd/L4"
    assert slow_compile.baseline["backend"] == "cpu" and slow_compile.baseline["mode"] == "eager"
    rows = {r["backend"]: r for r in slow_compile.backends}
    assert rows[TwinBackend.name]["ar_prepare_seconds"] == 100.0 and rows["onnx"]["status"].startswith("unavailable")
    seed(compiled, 1, {"ar": 0.2, "mc-sjd/L4": 0.1}, prepare_s={"ar": 1e-4, "mc-sjd/L4": 1e-4})
    cached = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    # a cached compile costs next to nothing: compiled wins, and the baseline is the compiled AR
    assert cached.backend == TwinBackend.name and cached.mode == "compiled" and cached.pipeline is compiled
    assert cached.plan.name == "mc-sjd/L4" and cached.baseline["backend"] == TwinBackend.name
    out = cached.to_dict()
    assert out["backend"] == TwinBackend.name and out["mode"] == "compiled"
    assert f"fastest AR, {TwinBackend.name} (compiled)" in out["why"]
    assert out["fastest_ar"]["predicted_seconds"] == pytest.approx(cached.baseline["predicted_seconds"])
    assert out["speedup_over_fastest_ar"] == pytest.approx(cached.speedup_over_fastest_ar)
    json.dumps(out)  # the --json plan is plain data
    # deciding from its cached calibration prepared only the chosen runner, and the ledger learnt its cost
    assert len(compiled.prepare_seconds) == 1
    key = calibration.calibration_key(TwinBackend.name, "fp32", eager.model_key, SAMPLING, eager.config.vocab_size)
    assert backend_choice.load_ledger(key)["widths"]["1"]["mc-sjd/L4"] < 1.0


@pytest.mark.usefixtures("unlimited_deciding")
def test_a_plan_must_beat_the_fastest_ar_not_its_own_backends(cache, tiny, two_modes):
    make = make_pipe_factory(tiny)
    eager, compiled = make("cpu", "fp32"), make(TwinBackend.name, "fp32")
    seed(eager, 1, {**everything(1000.0), "ar": 1.0, "mc-sjd/L4": 0.5}, prepare_s=FREE)
    mine = choose(eager, 1, SAMPLING, batch=1, progress=False)  # reads the tiny model's acceptance record
    steps = {r["plan"]: r["steps_per_image"] for r in mine.candidates if "steps_per_image" in r}
    assert mine.plan.name == "mc-sjd/L4"  # against eager AR alone, Jacobi wins
    # compiled AR, free to prepare, a little faster than eager Jacobi
    ar_ms = 1e3 * steps["mc-sjd/L4"] * 0.5e-3 / steps["ar"] * 0.95
    seed(compiled, 1, {"ar": ar_ms, "mc-sjd/L4": 1e3}, prepare_s={"ar": 0.0, "mc-sjd/L4": 0.0})
    c = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert c.plan == AR and c.backend == TwinBackend.name and c.baseline["backend"] == TwinBackend.name


def twin_key(pipe) -> dict:
    return calibration.calibration_key(TwinBackend.name, pipe.dtype, pipe.model_key, SAMPLING, pipe.config.vocab_size)


@pytest.mark.usefixtures("unlimited_deciding")  # the tiny model's acceptance record: measured, not weighed here
def test_a_compiled_ar_prepared_and_run_here_is_weighed_at_its_runs_and_its_preparation_again(cache, tiny,
                                                                                               two_modes):
    """The issue's scenario, as the files leave it: a `--method ar` run compiled AR on the compiled mode (its cold
    compile, 100 s, in the ledger) and timed its steps; its mode was never calibrated. The next auto weighs that AR
    at its measured step plus preparing it again against its compile on disk: WARM_SHARE of the cold compile
    until a second preparation is measured, then what that took. Never 0: a new process re-traces. (Steps of tens
    of milliseconds, so that the tiny model's real preparations here, a few milliseconds, decide nothing.)"""
    make = make_pipe_factory(tiny)
    eager = make("cpu", "fp32")
    seed(eager, 1, {**everything(1e5), "ar": 100.0, "mc-sjd/L4": 60.0}, prepare_s=FREE)
    write_ledger(twin_key(eager), 1, {}, first_s={"ar": 100.0}, step_ms={"ar": [30.0, 25.0, 40.0]})
    one = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    row = {r["backend"]: r for r in one.backends}[TwinBackend.name]
    assert row["status"] == "weighed" and row["cost_source"] == backend_choice.RAN
    assert row["ar_prepare_seconds"] == pytest.approx(backend_choice.WARM_SHARE * 100.0)
    assert one.backend == "cpu"  # a re-trace of 20 s outweighs what one image saves
    # a second preparation measured cheap: the compiled AR is the bar, at the median of its runs' steps
    write_ledger(twin_key(eager), 1, {"ar": 0.02}, step_ms={"ar": [30.0, 25.0, 40.0]})
    c = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert (c.plan, c.backend, c.mode) == (AR, TwinBackend.name, "compiled")
    assert c.prepare_s == pytest.approx(0.02) and c.prepare_source.startswith("prepared here before")
    steps = next(r["steps_per_image"] for r in c.candidates if r["plan"] == "ar")
    assert c.predicted_s == pytest.approx(steps * 30e-3)  # the median of its runs' steps, x AR's steps
    assert c.baseline["backend"] == TwinBackend.name and len(c.line()) <= choose_mod.LINE_MAX
    # a plan faster than that AR by the margin still wins over it
    seed(eager, 1, {**everything(1e5), "ar": 100.0, "mc-sjd/L4": 5.0}, prepare_s=FREE)
    write_ledger(twin_key(eager), 1, {"ar": 0.02}, step_ms={"ar": [30.0, 25.0, 40.0]})
    faster = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert (faster.plan.name, faster.backend) == ("mc-sjd/L4", "cpu")
    assert faster.baseline["backend"] == TwinBackend.name


@pytest.mark.usefixtures("unlimited_deciding")
def test_a_request_large_enough_pays_for_preparing_the_compiled_ar_again(cache, tiny, two_modes):
    """Preparing the compiled AR again (a re-trace) is a one-time cost: a one-image request runs eager AR, one
    whose images save more than that re-trace runs the compiled AR."""
    make = make_pipe_factory(tiny)
    eager = make("cpu", "fp32")
    seed(eager, 1, {**everything(1e5), "ar": 1.0}, prepare_s=FREE)
    write_ledger(twin_key(eager), 1, {"ar": 0.5}, step_ms={"ar": [0.3]})
    one = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert (one.plan, one.backend) == (AR, "cpu")
    steps = next(r["steps_per_image"] for r in one.candidates if r["plan"] == "ar")
    many = choose_backend(make, int(3 * 0.5 / (steps * 0.7e-3)) + 1, SAMPLING, batch=1, progress=False)
    assert (many.plan, many.backend, many.prepare_s) == (AR, TwinBackend.name, 0.5)


@pytest.mark.parametrize("field,value", [("again", 3.0), ("again", [-1.0]), ("started", [1.0]), ("ran", [None])])
def test_a_ledger_of_the_wrong_shape_is_started_again(cache, tiny, field, value):
    """A ledger field of the wrong shape (a hand-edited file) is not read as costs: the ledger starts again,
    instead of a crash or a cost from a malformed entry."""
    key = calibration.pipe_key(make_pipe_factory(tiny)("cpu", "fp32"), SAMPLING)
    write_json(ledger_path(key), {"key": key, "widths": {"1": {"ar": 1.0}}, field: {"1": {"ar": value}}})
    assert backend_choice.load_ledger(key) == {"key": key, "widths": {}}


def test_the_ledger_tells_a_preparation_repeated_from_the_same_one_recorded_again(cache, tiny):
    """A process records its preparation more than once (when auto chose it, after its generation, grown by a
    fused step's compile): that is its first preparation still. A later preparation of the same plan (a new
    process, against the compile on disk), or one made again on purpose, is a repeated one."""
    make = make_pipe_factory(tiny)
    eager = make("cpu", "fp32")
    key = calibration.pipe_key(eager, SAMPLING)
    decode, spec = AR.decode(SAMPLING), eager.spec(AR.decode(SAMPLING), 1)
    eager.runner(decode, 1)
    record_prepared(eager, key, 1, [AR], SAMPLING)
    eager.add_prepare_seconds(spec, 5.0)
    ledger = record_prepared(eager, key, 1, [AR], SAMPLING, step_s=0.01)
    assert ledger["widths"]["1"]["ar"] >= 5.0 and not ledger["again"]["1"]
    assert prepare_cost(None, ledger, AR, SAMPLING, 1, "eager")[0] == pytest.approx(
        backend_choice.WARM_SHARE * ledger["widths"]["1"]["ar"])
    eager.release()
    eager.runner(decode, 1)  # prepared again: a new preparation
    ledger = record_prepared(eager, key, 1, [AR], SAMPLING)
    assert len(ledger["again"]["1"]["ar"]) == 1 and ledger["widths"]["1"]["ar"] < 5.0
    assert prepare_cost(None, ledger, AR, SAMPLING, 1, "eager")[0] == ledger["widths"]["1"]["ar"]
    eager.add_prepare_seconds(spec, 1.0)  # the repeated one grown: updated, not counted twice
    ledger = record_prepared(eager, key, 1, [AR], SAMPLING)
    assert len(ledger["again"]["1"]["ar"]) == 1 and ledger["again"]["1"]["ar"][0] >= 1.0
    fresh = make("cpu", "bf16")  # a first preparation made again on purpose (calibrate: warm caches)
    fresh_key = calibration.pipe_key(fresh, SAMPLING)
    fresh.runner(AR.decode(SAMPLING), 1)
    assert record_prepared(fresh, fresh_key, 1, [AR], SAMPLING, again=True)["again"]["1"]["ar"]


def test_measured_runs_displace_a_quick_estimate_but_not_a_calibration(cache, tiny, two_modes):
    """Before any calibration, eager AR is known by a quick estimate of a few steps only, which can read it
    cheap: where eager AR also ran here, its measured runs weigh it, and the faster measured AR is chosen. A
    calibrated plan keeps its calibration's prediction: a run only says it is prepared."""
    make = make_pipe_factory(tiny)
    eager = make("cpu", "fp32")
    key = calibration.pipe_key(eager, SAMPLING)
    calibration.save_calibration({"key": key, "widths": {}, calibration.QUICK_AR: {"1": {"fixed_s": 0.0,
                                                                                       "step_s": 0.1e-3}}})
    write_ledger(key, 1, {"ar": 0.0}, step_ms={"ar": [1.0, 1.1, 0.9]})
    # preparing the compiled AR again: more than the quick estimate's request pays to calibrate its mode
    write_ledger(twin_key(eager), 1, {"ar": 0.004}, step_ms={"ar": [0.5]})
    c = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert (c.plan, c.backend) == (AR, TwinBackend.name)
    twin = {r["backend"]: r for r in c.backends}[TwinBackend.name]
    assert {r["backend"]: r for r in c.backends}["cpu"]["ar_seconds"] == pytest.approx(
        2 * (twin["ar_seconds"] - twin["ar_prepare_seconds"]))
    # eager calibrated (AR at 0.4 ms): its calibration weighs it, not its runs, and it is the faster AR
    seed(eager, 1, {**everything(1000.0), "ar": 0.4}, prepare_s=FREE)
    write_ledger(key, 1, {"ar": 0.0}, step_ms={"ar": [1.0]})
    calibrated = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert (calibrated.plan, calibrated.backend) == (AR, "cpu")


def test_a_run_records_its_median_step_not_the_compile_at_its_first_steps(cache, tiny):
    """A compiled runner's first generation can compile at its first steps (a fused step does; a graph recompiled
    for a new shape): its wall over its steps would read that compile as a slow step. The ledger keeps the median
    step (here a generation whose first step took 30 s of compiling, its others 10 ms)."""
    make = make_pipe_factory(tiny)
    eager = make("cpu", "fp32")
    run = SimpleNamespace(stats=SimpleNamespace(batch=2), step_seconds=[30.0, 0.011, 0.01, 0.009, 0.01])
    backend_choice.record_run(eager, AR.decode(SAMPLING), run)
    backend_choice.record_run(eager, method_preset("mc-sjd", SAMPLING, window=7), run)  # not one of auto's plans
    ledger = backend_choice.load_ledger(calibration.pipe_key(eager, SAMPLING))
    assert ledger["ran"] == {"2": {"ar": [0.01]}}


@pytest.mark.usefixtures("two_modes")
def test_a_named_run_leaves_what_the_next_auto_weighs_it_by(cache, tmp_path, monkeypatch, capsys):
    """The command line: `--method ar --backend <compiled mode>` leaves its mode's ledger holding what preparing
    AR took and its measured step; the next default request weighs that AR prepared at its measured step. The
    step times are then seeded (this test asserts the decision, not the machine's speed): eager AR measured
    slower than the compiled AR, so the default runs the compiled AR, saying so in one line."""
    from lantern.bundle import load_bundle
    from lantern.cli import main
    from tiny_bundle import write_tiny_bundle
    monkeypatch.delenv("LANTERN_BACKEND", raising=False)
    folder = write_tiny_bundle(tmp_path / "tiny")
    eager = Pipeline.from_bundle(load_bundle(str(folder)), backend="cpu")
    sampling = eager.defaults.sampling

    def generate(*flags: str) -> tuple[dict, str]:
        assert main(["generate", "--model", str(folder), "--classes", "3", "--no-images", "--json", *flags]) == 0
        out = capsys.readouterr()
        return json.loads(out.out), out.err
    assert generate("--method", "ar", "--backend", TwinBackend.name)[0]["backend"] == TwinBackend.name
    key = calibration.calibration_key(TwinBackend.name, "fp32", eager.model_key, sampling, eager.config.vocab_size)
    ledger = backend_choice.load_ledger(key)
    assert set(ledger["widths"]["1"]) == {"ar"} and len(ledger["ran"]["1"]["ar"]) == 1
    assert ledger["ran"]["1"]["ar"][0] > 0 and not ledger["again"]["1"]  # its first preparation
    generate("--method", "ar", "--backend", TwinBackend.name)  # another process: the same AR prepared again
    assert len(backend_choice.load_ledger(key)["again"]["1"]["ar"]) == 1
    # seeded: preparing it again (the twin compiles nothing; cpu-graph re-traces its compile for seconds: more
    # than this request pays to calibrate the mode), and step times the decision is read from
    write_ledger(key, 1, {"ar": 0.3}, step_ms={"ar": [50.0]})
    write_ledger(calibration.pipe_key(eager, sampling), 1, {"ar": 0.0}, step_ms={"ar": [100.0]})
    out, err = generate()
    assert (out["plan"]["plan"], out["backend"], out["plan"]["mode"]) == ("ar", TwinBackend.name, "compiled")
    assert out["plan"]["prepare_seconds"] == pytest.approx(0.3)
    line = next(x for x in err.splitlines() if x.startswith("lantern: auto chose"))
    assert f"ar on {TwinBackend.name} (compiled)" in line and len(line) <= len("lantern: ") + choose_mod.LINE_MAX


def test_modes_timed_at_different_moments_are_compared_on_the_default_modes_time_scale(cache, tiny, two_modes):
    """Each mode is calibrated at another moment of a machine whose speed drifts; its AR references were paired
    with the default mode's AR (`ar_to_anchor`), and that ratio, not the absolute seconds, compares them."""
    make = make_pipe_factory(tiny)
    eager, compiled = make("cpu", "fp32"), make(TwinBackend.name, "fp32")
    seed(eager, 1, {**everything(1000.0), "ar": 1.0}, prepare_s=FREE)
    # the compiled mode was timed in a slow spell: its AR read 2 ms, though paired runs put it at half eager's
    seed(compiled, 1, {"ar": 2.0, "mc-sjd/L4": 1e3}, prepare_s={"ar": 0.0, "mc-sjd/L4": 0.0})
    unpaired = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert unpaired.backend == "cpu" and "not anchored" in unpaired.backends[1]["cost_source"]
    key = calibration.calibration_key(TwinBackend.name, "fp32", eager.model_key, SAMPLING, eager.config.vocab_size)
    data = calibration.load_calibration(key)
    data["widths"]["1"]["ar_to_anchor"] = [0.55, 0.5, 0.45]
    calibration.save_calibration(data)
    paired = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert paired.backend == TwinBackend.name and paired.plan == AR
    row = {r["backend"]: r for r in paired.backends}[TwinBackend.name]
    assert "x0.25 onto cpu's time scale" in row["cost_source"]
    assert row["ar_seconds"] == pytest.approx(0.5 * {r["backend"]: r for r in paired.backends}["cpu"]["ar_seconds"])


def test_anchoring_scales_every_cost_of_an_entry_alike():
    entry = {"fixed_s": 0.1, "plans": {"ar": {"step_s": 0.004}, "mc-sjd/L4": {"step_s": 0.008, "lower_bound": True}},
             "ar_to_anchor": [1.0, 3.0, 2.0]}
    out = backend_choice.anchored(entry, anchor_ar_step_s=0.001)  # paired: 2x the anchor's 1 ms: 2 ms, not 4
    assert out["plans"]["ar"]["step_s"] == pytest.approx(0.002) and out["fixed_s"] == pytest.approx(0.05)
    assert out["plans"]["mc-sjd/L4"] == {"step_s": pytest.approx(0.004), "lower_bound": True}
    assert out["anchor_scale"] == pytest.approx(0.5) and entry["plans"]["ar"]["step_s"] == 0.004  # a copy
    assert backend_choice.anchored({k: v for k, v in entry.items() if k != "ar_to_anchor"}, 0.001)["fixed_s"] == 0.1


@pytest.mark.usefixtures("unlimited_deciding")
def test_an_uncalibrated_mode_is_calibrated_only_when_the_request_pays_for_it(cache, tiny, two_modes):
    make = make_pipe_factory(tiny)
    eager, compiled = make("cpu", "fp32"), make(TwinBackend.name, "fp32")
    seed(eager, 1, {**everything(1000.0), "ar": 1.0, "mc-sjd/L4": 0.5}, prepare_s=FREE)
    c = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    row = {r["backend"]: r for r in c.backends}[TwinBackend.name]
    # the prior compile cost (AR and two plans) exceeds a sub-second request: not calibrated, nothing compiled
    assert row["status"].startswith("not calibrated") and "lantern profile calibrate" in row["status"]
    assert f"{3 * PRIOR_PREPARE_S['compiled']:.0f} s" in row["status"]
    assert not compiled.prepare_seconds and c.backend == "cpu" and f"not weighed: {TwinBackend.name}" in c.why


@pytest.mark.usefixtures("unlimited_deciding")  # the tiny bundle's acceptance record: measured, not weighed here
def test_the_cli_weighs_a_compile_over_its_request_and_the_service_over_its_plan_images(cache, two_modes, tmp_path,
                                                                                         monkeypatch, capsys):
    """Two horizons, on the same calibrations (the compiled mode's steps a fifth of eager's, each of its runners
    COMPILE_S to prepare): `lantern generate` and an unpinned Pipeline.generate(..., "auto") weigh the compile over
    the images they were asked for, the service over its `plan_images` (4096 by default). One image does not pay
    for the compile, so the CLI and the pipeline run MC-SJD L=4 eager while the service compiles; a CLI request
    past the break-even (recomputed from the candidates the CLI reports) compiles too; a pinned pipeline plans on
    its own backend."""
    pytest.importorskip("prometheus_client")  # the serve extra
    from lantern.bundle import load_bundle
    from lantern.cli import main
    from lantern.serve.config import ServeConfig
    from lantern.serve.service import Service
    from tiny_bundle import write_tiny_bundle
    monkeypatch.delenv("LANTERN_BACKEND", raising=False)
    monkeypatch.setitem(registry.BUILTIN, TwinBackend.name, f"{__name__}:TwinBackend")  # a backend by name
    folder = write_tiny_bundle(tmp_path / "tiny")
    bundle = load_bundle(str(folder))
    eager = Pipeline.from_bundle(bundle, backend="cpu")
    served = eager.defaults.sampling  # what all of them plan at
    compile_s = 100.0
    seed(eager, 1, {**everything(1e5), "ar": 1000.0, "mc-sjd/L4": 500.0}, prepare_s=FREE, sampling=served)
    seed(eager, 1, {**everything(1e5), "ar": 200.0, "mc-sjd/L4": 100.0},  # every plan: none left to calibrate
         prepare_s={"ar": compile_s, "mc-sjd/L4": compile_s}, candidate=TwinBackend.name, sampling=served)

    def cli(*classes: int) -> dict:
        assert main(["generate", "--model", str(folder), "--classes", *map(str, classes), "--batch", "1",
                     "--no-images", "--json"]) == 0
        return json.loads(capsys.readouterr().out)
    one = cli(1)
    rows = {c["plan"]: c for c in one["plan"]["candidates"]}
    steps_per_image = (rows["mc-sjd/L4"]["predicted_seconds"] / 0.5)  # eager L=4: 0.5 s a step, no fixed cost
    break_even = compile_s / (steps_per_image * (0.5 - 0.1))  # images whose saved steps pay for the compile
    assert 1 < break_even < ServeConfig().plan_images, break_even
    unpinned = Pipeline.from_bundle(bundle)  # before the service prepares (compiles) the compiled mode's runners
    result = unpinned.generate([1], "auto", batch=1)
    service = Service(ServeConfig(model=str(folder), batch=1, threads=1))  # built, not started; its own horizon
    served_by, serving = service._plan()
    assert (one["plan"]["plan"], one["backend"], one["plan"]["mode"]) == ("mc-sjd/L4", "cpu", "eager")
    assert (result.plan.plan.name, result.backend, result.plan.mode) == ("mc-sjd/L4", "cpu", "eager")
    assert not unpinned.pinned and result.decode == result.plan.decode
    assert (serving.name, served_by.backend.name) == ("mc-sjd/L4", TwinBackend.name)
    assert serving.why.startswith(f"mc-sjd/L4 on {TwinBackend.name} (compiled)")
    assert f"weighed over {ServeConfig().plan_images} images" in serving.why
    many = cli(*[c % 4 for c in range(math.ceil(break_even) + 1)])  # past the break-even: the CLI compiles too
    assert (many["plan"]["plan"], many["backend"], many["plan"]["mode"]) == ("mc-sjd/L4", TwinBackend.name,
                                                                             "compiled")
    pinned = eager.plan(1, batch=1, progress=False)
    assert pinned.pipeline is eager and pinned.backend == "cpu" and pinned.plan.name == "mc-sjd/L4"
    assert pinned.why == "mc-sjd/L4 on cpu (pinned)" and "backend" not in pinned.to_dict()  # as before


def test_pinned_backend_wins_over_auto(monkeypatch):
    monkeypatch.delenv("LANTERN_BACKEND", raising=False)
    assert pinned_backend(None) is None and pinned_backend("auto") is None
    assert pinned_backend("cpu-graph") == "cpu-graph"
    monkeypatch.setenv("LANTERN_BACKEND", "onnx")
    assert pinned_backend(None) == "onnx" and pinned_backend("cpu") == "cpu"


def test_candidate_modes_start_with_the_default_and_say_why_others_are_out(monkeypatch):
    monkeypatch.delenv("LANTERN_BACKEND", raising=False)
    names, left_out, dtype = candidate_backends(None)
    assert names[0] == "cpu" and dtype == "fp32" and "cpu-graph" in names and "cpu-graph" + FUSED in names
    assert backend_of("cpu-graph" + FUSED) == ("cpu-graph", {"fused_step": True})
    assert backend_of("cpu-graph") == ("cpu-graph", {})
    assert {backend_of(n)[0] for n in names} | {r["backend"] for r in left_out} == {"cpu", "cpu-graph", "onnx"}
    assert all(r["status"].startswith("unavailable") for r in left_out)
    bf16, out16, _ = candidate_backends("bf16")
    assert "onnx" not in bf16 and "cpu-graph" in bf16
    assert any(r["backend"] == "onnx" and r["status"].startswith("unavailable") for r in out16)


def test_on_cuda_auto_weighs_the_fused_step_too(monkeypatch):
    """A machine whose default backend is cuda: the fused CUDA-graph step is one of auto's modes, labelled fused
    (each mode's dtypes as its class declares them: none is built, so no device is needed)."""
    def available(name):  # the registered class, as if its device were here
        return type(name, (registry.backend_class(name),), {"availability": classmethod(
            lambda cls: SimpleNamespace(ok=True, reason=""))})
    monkeypatch.setattr(backend_choice, "resolve_name", lambda name: "cuda")
    monkeypatch.setattr(backend_choice, "backend_class", available)
    names, left_out, dtype = candidate_backends(None)
    assert names == ["cuda", "cuda-graph", "cuda-graph" + FUSED] and dtype == "bf16"
    assert [(r["backend"], r["status"]) for r in left_out] == [("onnx-cuda", "unavailable: no bf16")]
    assert mode_row("cuda-graph" + FUSED)["mode"] == "fused" and mode_row("cuda-graph")["mode"] == "compiled"


# --- the first-run probe: a cold machine's deciding work is bounded by counting it -------------------------------
def counting_runs(monkeypatch):
    """Wrap calibration's timed runs: how many, and how many tokens (images x tokens) they generated."""
    work = {"runs": 0, "tokens": 0}
    real = calibration._short_run

    def counted(pipe, dcfg, width, tokens, attended=0.5, prompts=None):
        work["runs"] += 1
        work["tokens"] += width * tokens
        return real(pipe, dcfg, width, tokens, attended, prompts)
    monkeypatch.setattr(calibration, "_short_run", counted)
    return work


def cold(cache):
    for f in (cache / "calibration").glob("*.json"):
        f.unlink()


def test_a_cold_cache_decides_with_a_bounded_probe(cache, tiny, monkeypatch):
    target, drafter, proximity = tiny
    pipe = Pipeline(target, drafter, proximity, backend="cpu", defaults=ModelDefaults(sampling=SAMPLING))
    choose(pipe, 1, SAMPLING, batch=1, progress=False)  # the acceptance record (a model property) and a probe
    cold(cache)
    work = counting_runs(monkeypatch)
    monkeypatch.setenv(deciding.SHARE_ENV, "1e9")  # a credit for the probe, never for full rounds of an infinite budget
    monkeypatch.setattr(calibration, "BUDGET_S", float("inf"))  # no time budget: only the work bound stops it
    monkeypatch.setitem(choose_mod.PROBE_ROUNDS, "budget", float("inf"))
    probe = choose(pipe, 1, SAMPLING, batch=1, progress=False)
    plans = len([r for r in probe.candidates if "predicted_seconds" in r])
    # a fixed cost (a warm-up and FIXED_REPEATS one-token runs), then per plan at most a warm-up, one AR
    # reference and one run of its own, each of a few steps, the leader's confirmation (and that of the plans
    # close to it: two more pairs each at most) and a closing AR reference (the disturbance check's)
    confirming = choose_mod.PROBE_ROUNDS["max_rounds"] - choose_mod.PROBE_ROUNDS["rounds"]
    assert work["runs"] <= 1 + calibration.FIXED_REPEATS + 3 * plans + 2 * confirming * plans + 1
    assert "first-run probe" in probe.cost_source
    key = calibration.pipe_key(pipe, SAMPLING)
    entry = calibration.load_calibration(key)["widths"]["1"]
    timed = [len(v["ratio_to_ar"]) for v in entry["plans"].values() if "ratio_to_ar" in v]
    assert entry["provisional"] and max(timed) <= choose_mod.PROBE_ROUNDS["max_rounds"]
    # a short request keeps the provisional entry (nothing measured) ...
    work["runs"] = 0
    again = choose(pipe, 1, SAMPLING, batch=1, progress=False)
    assert work["runs"] == 0 and again.calibrated_s == 0.0 and "first-run probe" in again.cost_source
    # ... a request whose AR takes at least the full calibration's budget pays for refining it, in full rounds
    monkeypatch.setattr(calibration, "BUDGET_S", 1e-9)
    refined = choose(pipe, 1, SAMPLING, batch=1, progress=False)
    assert refined.calibrated_s > 0 and "first-run probe" not in refined.cost_source
    assert "provisional" not in calibration.load_calibration(key)["widths"]["1"]
    # ... and so does such a request on a cold cache, right after its probe: it decides on full rounds
    cold(cache)
    paying = choose(pipe, 1, SAMPLING, batch=1, progress=False)
    assert "first-run probe" not in paying.cost_source
    entry = calibration.load_calibration(key)["widths"]["1"]
    assert "provisional" not in entry


def test_the_full_calibration_does_more_work_than_the_probe(cache, tiny, monkeypatch):
    """The bound above is a real one: the same cold start in full rounds times AR (which always contends) in
    every round, where the probe times it once."""
    target, drafter, proximity = tiny
    pipe = Pipeline(target, drafter, proximity, backend="cpu", defaults=ModelDefaults(sampling=SAMPLING))
    choose(pipe, 1, SAMPLING, batch=1, progress=False)
    monkeypatch.setenv(deciding.SHARE_ENV, "1e9")  # a credit for the probe, never for full rounds of an infinite budget
    monkeypatch.setattr(calibration, "BUDGET_S", float("inf"))
    key = calibration.pipe_key(pipe, SAMPLING)
    ar_runs = []
    for rounds in (1, 3):
        cold(cache)
        monkeypatch.setattr(choose_mod, "PROBE_ROUNDS", {"rounds": rounds, "max_rounds": rounds,
                                                         "budget": float("inf")})
        choose(pipe, 1, SAMPLING, batch=1, progress=False)
        ar_runs.append(len(calibration.load_calibration(key)["widths"]["1"]["plans"]["ar"]["ratio_to_ar"]))
    assert ar_runs == [1, 3]


def test_another_mode_is_calibrated_when_the_request_pays_or_when_asked(cache, tiny, monkeypatch):
    monkeypatch.setattr(backend_choice, "candidate_backends", lambda dtype=None: (["cpu", "cpu-twin"], [], "fp32"))
    monkeypatch.setitem(registry.BUILTIN, TwinBackend.name, f"{__name__}:TwinBackend")  # its mode: as declared
    make = make_pipe_factory(tiny)
    twin = make(TwinBackend.name, "fp32")
    eager = make("cpu", "fp32")
    seed(eager, 1, {**everything(1000.0), "ar": 50.0, "mc-sjd/L4": 25.0}, prepare_s=FREE)
    key = calibration.calibration_key("cpu-twin", "fp32", eager.model_key, SAMPLING, eager.config.vocab_size)
    # its prepare cost unknown: the prior (30 s a runner) is more than the request: not calibrated
    skipped = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert {r["backend"]: r for r in skipped.backends}["cpu-twin"]["status"].startswith("not calibrated")
    assert not twin.prepare_seconds and not calibration.load_calibration(key)["widths"]
    # asked to (lantern profile calibrate): AR and the two best plans, in full rounds, then weighed; the preparation
    # the ledger keeps is measured after this process's compiled graphs are dropped, as a new process pays it
    forgotten = []
    monkeypatch.setattr(TwinBackend, "forget_prepared",
                        classmethod(lambda cls: forgotten.append(dict(twin.prepare_seconds))))
    asked = choose_backend(make, 1, SAMPLING, batch=1, progress=False, calibrate_all=True)
    assert len(forgotten) == 1
    entry = calibration.load_calibration(key)["widths"]["1"]
    ranked = sorted((r for r in choose(eager, 1, SAMPLING, batch=1, progress=False).candidates
                     if "predicted_seconds" in r and not r.get("lower_bound") and r["plan"] != "ar"),
                    key=lambda r: r["predicted_seconds"])
    assert set(entry["plans"]) == {"ar", *(r["plan"] for r in ranked[:backend_choice.CROSS_PLANS])}
    assert not entry.get("provisional") and asked.calibrated_s > 0
    assert len(entry["plans"]["ar"]["ratio_to_ar"]) >= calibration.ROUNDS
    twin_row = {r["backend"]: r for r in asked.backends}["cpu-twin"]
    assert twin_row["status"] == "weighed" and twin_row["cost_source"].startswith("calibration cached")
    ledger = backend_choice.load_ledger(key)["widths"]["1"]
    timed = {name for name, v in entry["plans"].items() if not v.get("lower_bound")}  # (a floor is never prepared)
    assert set(ledger) == timed and all(s > 0 for s in ledger.values())
    # once the ledger knows the twin's runners prepare fast, a request pays for what it lacks by itself
    calibration.save_calibration({"key": key, "widths": {}})
    write_json(ledger_path(key), {"key": key, "widths": {"1": {name: 0.01 for name in entry["plans"]}}})
    paid = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert {r["backend"]: r for r in paid.backends}["cpu-twin"]["status"] == "weighed"
    probed = calibration.load_calibration(key)["widths"]["1"]  # a short request: the first-run probe
    assert probed["provisional"]
    assert len(probed["plans"]["ar"]["ratio_to_ar"]) <= choose_mod.PROBE_ROUNDS["max_rounds"]
    # each of its AR references was paired with a run of the default mode's AR: the entry carries its anchor
    # (a tiny model's reference step can read 0 under load, its wall within the fixed cost's noise: the median counts)
    assert probed["ar_to_anchor"] and statistics.median(probed["ar_to_anchor"]) > 0
    # a request whose AR takes at least the full calibration's budget (a service weighing thousands of images)
    # refines the probe in full rounds, as it would the default mode's: one round is noise at a choice's margin
    refined = choose_backend(make, 10_000, SAMPLING, batch=1, progress=False)
    entry = calibration.load_calibration(key)["widths"]["1"]
    assert not entry.get("provisional") and len(entry["plans"]["ar"]["ratio_to_ar"]) >= calibration.ROUNDS
    twin_row = {r["backend"]: r for r in refined.backends}["cpu-twin"]
    assert twin_row["cost_source"].startswith("calibration cached")


# --- the fused step as a mode: cpu-graph with the engine's whole step as one graph ------------------------------
@pytest.fixture
def three_modes(monkeypatch):
    """This machine runs eager, compiled and fused (the eager backend under another name, with and without
    fused_step: choosing either compiles nothing; ONNX left out)."""
    out = [{"backend": "onnx", "mode": "onnx", "status": "unavailable: left out by the test"}]
    monkeypatch.setitem(registry.BUILTIN, TwinBackend.name, f"{__name__}:TwinBackend")  # its modes: as declared
    monkeypatch.setattr(backend_choice, "candidate_backends",
                        lambda dtype=None: (["cpu", TwinBackend.name, TwinBackend.name + FUSED], out, dtype or "fp32"))


@pytest.mark.usefixtures("unlimited_deciding")  # the tiny model's acceptance record: measured, not weighed here
def test_the_fused_mode_wins_when_its_costs_do_and_its_compile_counts_until_cached(cache, tiny, three_modes):
    make = make_pipe_factory(tiny)
    eager, compiled = make("cpu", "fp32"), make(TwinBackend.name, "fp32")
    fused = make(TwinBackend.name, "fp32", fused_step=True)
    seed(eager, 1, {**everything(1000.0), "ar": 1.0, "mc-sjd/L4": 0.5}, prepare_s=FREE)
    seed(compiled, 1, {"ar": 0.5, "mc-sjd/L4": 0.4}, prepare_s=FREE)
    # the fused step makes Jacobi's step a quarter of the compiled one's; its compile never measured here
    fast_steps = {"ar": 0.45, "mc-sjd/L4": 0.1}
    seed(fused, 1, fast_steps, candidate=TwinBackend.name + FUSED)
    cold = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    rows = {(r["backend"], r["mode"]): r for r in cold.backends}
    row = rows[TwinBackend.name, "fused"]
    # the prior compile (60 s a runner) is counted against a sub-second request: the fused mode loses
    assert row["status"] == "weighed" and row["fused_step"] and not rows[TwinBackend.name, "compiled"]["fused_step"]
    assert row["best_prepare_seconds"] == row["ar_prepare_seconds"] == PRIOR_PREPARE_S["fused"]
    assert cold.mode != "fused" and not cold.to_dict()["fused_step"]
    assert not fused.prepare_seconds  # weighed from its cached calibration: nothing prepared or compiled
    # preparing it again here was slow: still counted, still loses
    seed(fused, 1, fast_steps, candidate=TwinBackend.name + FUSED, prepare_s={"ar": 100.0, "mc-sjd/L4": 100.0})
    slow = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert slow.mode != "fused"
    slow_rows = {(r["backend"], r["mode"]): r for r in slow.backends}
    assert slow_rows[TwinBackend.name, "fused"]["ar_prepare_seconds"] == 100.0
    # the compile cached (preparing it again took next to nothing): the fused mode wins, and the plan says so
    seed(fused, 1, fast_steps, candidate=TwinBackend.name + FUSED, prepare_s={"ar": 1e-4, "mc-sjd/L4": 1e-4})
    warm = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert warm.pipeline is fused and warm.pipeline.backend.fused_step
    assert warm.backend == TwinBackend.name and warm.mode == "fused" and warm.fused_step
    assert "narrowed" not in warm.line()  # every mode was weighed: no --profile narrowed it
    assert warm.plan.name == "mc-sjd/L4" and warm.prepare_source.startswith("prepared here before")
    out = json.loads(json.dumps(warm.to_dict()))  # the --json plan: plain data naming backend, mode and why
    assert (out["backend"], out["mode"], out["fused_step"]) == (TwinBackend.name, "fused", True)
    assert out["why"].startswith(f"mc-sjd/L4 on {TwinBackend.name} (fused)")
    assert out["fastest_ar"]["mode"] in ("eager", "compiled", "fused")
    # the chosen runner was prepared here, under the fused mode's own ledger
    key = calibration.calibration_key(TwinBackend.name + FUSED, "fp32", eager.model_key, SAMPLING,
                                      eager.config.vocab_size)
    assert set(backend_choice.load_ledger(key)["widths"]["1"]) == {"ar", "mc-sjd/L4"} and fused.prepare_seconds


def test_a_fused_runner_is_prepared_only_once_its_step_has_compiled(cache):
    """A real cpu-graph fused runner (dynamo's eager compiler: tracing, no inductor): the step compiles at an
    engine's first steps, so the runner alone is not prepared; compile_fused_step runs those steps, and the
    pipeline's preparation seconds, hence the ledger, include the step's compile."""
    cfg = GPTConfig(dim=64, n_layer=1, n_head=4, vocab_size=64, num_classes=4, block_size=16, multiple_of=32)
    target, drafter, proximity = make_models(cfg)
    pipe = Pipeline(target, drafter, proximity, backend="cpu-graph", compiler="eager", fused_step=True)
    ar = method_preset("ar", SamplingConfig(greedy=True))
    torch._dynamo.reset()
    try:
        runner = pipe.runner(ar, 1)
        spec = pipe.spec(ar, 1)
        prefill_only = pipe.prepare_seconds[spec]
        assert runner.fused and not runner.fused_warm(ar) and not pipe.prepared(ar, 1)
        assert calibration.costs_name(pipe) == "cpu-graph" + FUSED  # its costs are not per-module graphs'
        key = calibration.pipe_key(pipe, SAMPLING)
        empty = {"key": key, "widths": {}}
        assert prepare_cost(pipe, empty, AR, SamplingConfig(greedy=True), 1, "fused") == (
            PRIOR_PREPARE_S["fused"], "prior: never prepared here")
        calibration.compile_fused_step(pipe, ar, 1)
        assert runner.fused_warm(ar) and pipe.prepared(ar, 1) and pipe.runner(ar, 1) is runner
        assert pipe.prepare_seconds[spec] == pytest.approx(prefill_only + runner.fused_warmup_seconds)
        assert runner.fused_warmup_seconds > 0
        ledger = record_prepared(pipe, key, 1, [AR], SamplingConfig(greedy=True))
        assert ledger["widths"]["1"]["ar"] == pytest.approx(pipe.prepare_seconds[spec])
        assert prepare_cost(pipe, ledger, AR, SamplingConfig(greedy=True), 1, "fused") == (
            0.0, "prepared in this process")
    finally:
        torch._dynamo.reset()
