"""`--method auto` across backends and modes (lantern.plan.backend_choice), against the fastest AR, with one-time
compile costs counted; and the first-run probe that bounds a cold machine's deciding work (lantern.plan.choose)."""
import json

import pytest

from lantern.backends.torch_eager import CPUBackend

from lantern.api import ModelDefaults, Pipeline
from lantern.atomic_io import write_json
from lantern.decoding.sampling import SamplingConfig
from lantern.plan import backend_choice, calibration, choose as choose_mod
from lantern.plan.backend_choice import PRIOR_PREPARE_S, candidate_backends, choose_backend, ledger_path, pinned_backend
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
    # these tests pin the cost model and the modes, not the disturbance check (tests/test_faults.py pins it): the
    # tiny model's sub-millisecond steps under the parallel suite's load would read as disturbed at random
    monkeypatch.setattr(calibration, "disturbance", lambda entry: "")
    for kind in ("calibration", "prepare"):
        for f in (module_cache / kind).glob("*.json"):
            f.unlink()
    return module_cache


class TwinBackend(CPUBackend):
    """The eager CPU backend under another name: a second mode whose calibration this test can afford."""

    name = "cpu-twin"


def make_pipe_factory(models):
    target, drafter, proximity = models
    made = {}

    def make(name, dtype):
        if (name, dtype) not in made:
            pipe = Pipeline(target, drafter, proximity, backend="cpu" if name == TwinBackend.name else name,
                            dtype=dtype, defaults=ModelDefaults(sampling=SAMPLING))
            if name == TwinBackend.name:
                pipe.backend = TwinBackend()
            made[name, dtype] = pipe
        return made[name, dtype]
    return make


def seed(pipe, width: int, step_ms: dict, fixed_s: float = 0.0, prepare_s: dict | None = None) -> None:
    """A synthetic calibration (made by the test) for this pipeline's backend: the plans named in step_ms only;
    prepare_s: the ledger's last preparation seconds per plan."""
    key = calibration.calibration_key(pipe.backend.name, pipe.dtype, pipe.model_key)
    plans = {name: {"step_s": ms / 1e3} for name, ms in step_ms.items()}
    calibration.save_calibration({"key": key, "widths": {str(width): {"fixed_s": fixed_s, "plans": plans}}})
    if prepare_s is not None:
        write_json(ledger_path(key), {"key": key, "widths": {str(width): prepare_s}})


FREE = {"ar": 0.0, "mc-sjd/L4": 0.0}  # eager runners' last preparation, negligible


def everything(ms: float) -> dict:
    return {p.name: ms for p in candidate_plans(True, True, {m: {} for m in RELAXED_METHODS})}


@pytest.fixture
def two_modes(monkeypatch):
    """This machine runs eager and a compiled mode (the eager backend under another name, so choosing it compiles
    nothing; ONNX left out, whether installed or not)."""
    out = [{"backend": "onnx", "mode": "onnx", "status": "unavailable: left out by the test"}]
    monkeypatch.setitem(backend_choice.MODES, TwinBackend.name, "compiled")
    monkeypatch.setattr(backend_choice, "candidate_backends",
                        lambda dtype=None: (["cpu", TwinBackend.name], out, dtype or "fp32"))


def test_compile_cost_decides_between_eager_and_compiled(cache, tiny, two_modes):
    make = make_pipe_factory(tiny)
    eager, compiled = make("cpu", "fp32"), make(TwinBackend.name, "fp32")
    # compiled steps cost a fifth of eager ones; Jacobi L=4 half of AR on both
    seed(eager, 1, {**everything(1000.0), "ar": 1.0, "mc-sjd/L4": 0.5}, prepare_s=FREE)
    seed(compiled, 1, {"ar": 0.2, "mc-sjd/L4": 0.1}, prepare_s={"ar": 100.0, "mc-sjd/L4": 100.0})
    slow_compile = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    # 100 s of compile swamps any step saving: eager, and the fastest AR is eager's (prepare counted)
    assert slow_compile.backend == "cpu" and slow_compile.mode == "eager"
    assert slow_compile.choice.plan.name == "mc-sjd/L4"
    assert slow_compile.baseline["backend"] == "cpu" and slow_compile.baseline["mode"] == "eager"
    rows = {r["backend"]: r for r in slow_compile.backends}
    assert rows[TwinBackend.name]["ar_prepare_seconds"] == 100.0 and rows["onnx"]["status"].startswith("unavailable")
    seed(compiled, 1, {"ar": 0.2, "mc-sjd/L4": 0.1}, prepare_s={"ar": 1e-4, "mc-sjd/L4": 1e-4})
    cached = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    # a cached compile costs next to nothing: compiled wins, and the baseline is the compiled AR
    assert cached.backend == TwinBackend.name and cached.mode == "compiled" and cached.pipeline is compiled
    assert cached.choice.plan.name == "mc-sjd/L4" and cached.baseline["backend"] == TwinBackend.name
    out = cached.to_dict()
    assert out["backend"] == TwinBackend.name and out["mode"] == "compiled"
    assert f"fastest AR, {TwinBackend.name} (compiled)" in out["why"]
    assert out["fastest_ar"]["predicted_seconds"] == pytest.approx(cached.baseline["predicted_seconds"])
    assert out["speedup_over_fastest_ar"] == pytest.approx(cached.speedup_over_fastest_ar)
    json.dumps(out)  # the --json plan is plain data
    # deciding from its cached calibration prepared only the chosen runner, and the ledger learnt its cost
    assert len(compiled.prepare_seconds) == 1
    key = calibration.calibration_key(TwinBackend.name, "fp32", eager.model_key)
    assert backend_choice.load_ledger(key)["widths"]["1"]["mc-sjd/L4"] < 1.0


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
    assert c.choice.plan == AR and c.backend == TwinBackend.name and c.baseline["backend"] == TwinBackend.name


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


def test_pinned_backend_wins_over_auto(monkeypatch):
    monkeypatch.delenv("LANTERN_BACKEND", raising=False)
    assert pinned_backend(None) is None and pinned_backend("auto") is None
    assert pinned_backend("cpu-graph") == "cpu-graph"
    monkeypatch.setenv("LANTERN_BACKEND", "onnx")
    assert pinned_backend(None) == "onnx" and pinned_backend("cpu") == "cpu"


def test_candidate_modes_start_with_the_default_and_say_why_others_are_out(monkeypatch):
    monkeypatch.delenv("LANTERN_BACKEND", raising=False)
    names, left_out, dtype = candidate_backends(None)
    assert names[0] == "cpu" and dtype == "fp32" and "cpu-graph" in names
    assert set(names) | {r["backend"] for r in left_out} == {"cpu", "cpu-graph", "onnx"}
    assert all(r["status"].startswith("unavailable") for r in left_out)
    bf16, out16, _ = candidate_backends("bf16")
    assert "onnx" not in bf16 and "cpu-graph" in bf16
    assert any(r["backend"] == "onnx" and r["status"].startswith("unavailable") for r in out16)


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
    monkeypatch.setattr(calibration, "BUDGET_S", float("inf"))  # no time budget: only the work bound stops it
    monkeypatch.setitem(choose_mod.PROBE_ROUNDS, "budget", float("inf"))
    probe = choose(pipe, 1, SAMPLING, batch=1, progress=False)
    plans = len([r for r in probe.candidates if "predicted_seconds" in r])
    # a fixed cost (a warm-up and FIXED_REPEATS one-token runs), then per plan at most a warm-up, one AR
    # reference and one run of its own, each of a few steps, and a closing AR reference (the disturbance check's)
    assert work["runs"] <= 1 + calibration.FIXED_REPEATS + 3 * plans + 1
    assert "first-run probe" in probe.cost_source
    key = calibration.calibration_key("cpu", "fp32", pipe.model_key)
    entry = calibration.load_calibration(key)["widths"]["1"]
    assert entry["provisional"] and all(len(v.get("ratio_to_ar", [0])) <= 1 for v in entry["plans"].values())
    # a short request keeps the provisional entry (nothing measured) ...
    work["runs"] = 0
    again = choose(pipe, 1, SAMPLING, batch=1, progress=False)
    assert work["runs"] == 0 and again.calibrated_s == 0.0 and "first-run probe" in again.cost_source
    # ... a request whose AR takes at least the full calibration's budget pays for refining it, in full rounds
    monkeypatch.setattr(calibration, "BUDGET_S", 1e-9)
    refined = choose(pipe, 1, SAMPLING, batch=1, progress=False)
    assert refined.calibrated_s > 0 and "first-run probe" not in refined.cost_source
    assert "provisional" not in calibration.load_calibration(key)["widths"]["1"]


def test_the_full_calibration_does_more_work_than_the_probe(cache, tiny, monkeypatch):
    """The bound above is a real one: the same cold start in full rounds times AR (which always contends) in
    every round, where the probe times it once."""
    target, drafter, proximity = tiny
    pipe = Pipeline(target, drafter, proximity, backend="cpu", defaults=ModelDefaults(sampling=SAMPLING))
    choose(pipe, 1, SAMPLING, batch=1, progress=False)
    monkeypatch.setattr(calibration, "BUDGET_S", float("inf"))
    key = calibration.calibration_key("cpu", "fp32", pipe.model_key)
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
    make = make_pipe_factory(tiny)
    twin = make(TwinBackend.name, "fp32")
    eager = make("cpu", "fp32")
    seed(eager, 1, {**everything(1000.0), "ar": 50.0, "mc-sjd/L4": 25.0}, prepare_s=FREE)
    key = calibration.calibration_key("cpu-twin", "fp32", eager.model_key)
    # its prepare cost unknown: the prior (30 s a runner) is more than the request: not calibrated
    skipped = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert {r["backend"]: r for r in skipped.backends}["cpu-twin"]["status"].startswith("not calibrated")
    assert not twin.prepare_seconds and not calibration.load_calibration(key)["widths"]
    # asked to (lantern profile calibrate): AR and the two best plans, one round, then weighed
    asked = choose_backend(make, 1, SAMPLING, batch=1, progress=False, calibrate_all=True)
    entry = calibration.load_calibration(key)["widths"]["1"]
    ranked = sorted((r for r in choose(eager, 1, SAMPLING, batch=1, progress=False).candidates
                     if "predicted_seconds" in r and not r.get("lower_bound") and r["plan"] != "ar"),
                    key=lambda r: r["predicted_seconds"])
    assert set(entry["plans"]) == {"ar", *(r["plan"] for r in ranked[:backend_choice.CROSS_PLANS])}
    assert entry["provisional"] and asked.calibrated_s > 0
    twin_row = {r["backend"]: r for r in asked.backends}["cpu-twin"]
    assert twin_row["status"] == "weighed" and twin_row["cost_source"].startswith("first-run probe calibration cached")
    ledger = backend_choice.load_ledger(key)["widths"]["1"]
    timed = {name for name, v in entry["plans"].items() if not v.get("lower_bound")}  # (a floor is never prepared)
    assert set(ledger) == timed and all(s > 0 for s in ledger.values())
    # once the ledger knows the twin's runners prepare fast, a request pays for what it lacks by itself
    calibration.save_calibration({"key": key, "widths": {}})
    write_json(ledger_path(key), {"key": key, "widths": {"1": {name: 0.01 for name in entry["plans"]}}})
    paid = choose_backend(make, 1, SAMPLING, batch=1, progress=False)
    assert {r["backend"]: r for r in paid.backends}["cpu-twin"]["status"] == "weighed"
