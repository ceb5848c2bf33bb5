"""`--method auto`: the cost model's arithmetic, the choice it makes from calibrations and acceptance records,
the caches, and the command line (plan in --json, flags auto decides refused)."""
import contextlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from lantern.api import ModelDefaults, Pipeline
from lantern.decoding.config import method_preset
from lantern.decoding.sampling import SamplingConfig
from lantern.plan import calibration, acceptance_records as records
from lantern.plan.candidates import AR, RELAXED_METHODS, candidate_plans
from lantern.plan.choose import MIN_SPEEDUP, allowed_relaxation, choose
from lantern.plan.cost_model import predict_seconds

SAMPLING = SamplingConfig(temperature=1.0, top_k=5, cfg_scale=2.0)


def test_expected_max_is_the_order_statistic_of_the_images_distributions():
    steps = [3, 5, 5, 9]
    for k in (1, 2, 3):
        brute = sum(max(draw) for draw in itertools.product(steps, repeat=k)) / len(steps) ** k
        assert records.expected_max([steps] * k) == pytest.approx(brute)
    assert records.expected_max([steps]) == pytest.approx(sum(steps) / 4)
    assert records.expected_max([steps] * 50) == pytest.approx(9, abs=1e-5)  # many images: the slowest one
    easy, hard = [2, 4], [3, 7, 8]  # images with distributions of their own
    brute = sum(max(a, b) for a in easy for b in hard) / 6
    assert records.expected_max([easy, hard]) == pytest.approx(brute)


def test_a_chunk_attends_past_the_middle_once_its_first_image_is_done():
    steps = [3, 5, 5, 9]
    brute = sum(min(draw) for draw in itertools.product(steps, repeat=3)) / len(steps) ** 3
    assert records.expected_min([steps] * 3) == pytest.approx(brute)
    assert records.attended_fraction([steps]) == pytest.approx(0.5)  # one image: its middle, on average
    assert records.attended_fraction([[255]] * 10) == pytest.approx(0.5)  # lockstep (AR)
    # done after 4 steps, the first image pads at full length while the other needs 4 more
    assert records.attended_fraction([[4], [8]]) == pytest.approx((4 * 0.5 + 4 * 1.0) / 8)


def test_prediction_counts_chunks_and_the_short_last_one():
    # 5 images, 2 per step: chunks of 2, 2, 1; every image needs 10 steps
    assert predict_seconds(2, fixed_s=1.0, step_s=0.5, images=[[10]] * 5) == pytest.approx(3 * (1.0 + 5.0))
    # uneven images: the 1-image chunk waits for one image, the 2-image chunks for the slower of two
    two = records.expected_max([[4, 8], [4, 8]])
    assert predict_seconds(2, 0.0, 1.0, [[4, 8]] * 5) == pytest.approx(2 * two + 6.0)
    # chunks are consecutive images: two hard images together cost one chunk's wait, not two
    assert predict_seconds(2, 0.0, 1.0, [[9], [9], [1], [1]]) == pytest.approx(10.0)


def test_per_class_steps_are_shrunk_toward_all_images_by_how_much_classes_differ():
    # classes that really differ (means 10 and 30, little noise): each class keeps about its own mean
    steps, conds = [9, 11, 10, 29, 31, 30], [0, 0, 0, 1, 1, 1]
    zero, one, unknown = records.per_image_steps(steps, conds, [0, 1, None])
    assert statistics.fmean(zero) == pytest.approx(10, abs=0.1) and statistics.fmean(one) == pytest.approx(30, abs=0.1)
    assert sorted(unknown) == sorted(steps)  # an unknown class: every image of the record
    assert statistics.pvariance(zero) == pytest.approx(1.0)  # the within-class spread (s2 = 1), not the pooled one
    # classes whose means differ by no more than their noise: every class gets the overall mean
    steps, conds = [5, 15, 15, 5, 10, 10], [0, 0, 1, 1, 2, 2]
    for values in records.per_image_steps(steps, conds, [0, 1, 2]):
        assert statistics.fmean(values) == pytest.approx(10)
    # in between, the estimate lies between the class's mean and the overall one
    steps, conds = [8, 14, 14, 20], [0, 0, 1, 1]
    (zero,) = records.per_image_steps(steps, conds, [0])
    assert 11 < statistics.fmean(zero) < 14
    assert records.per_image_steps([4, 6], None, [0, 0]) == [[4.0, 6.0], [4.0, 6.0]]  # a record without classes


def test_shrunk_class_means_beat_raw_and_pooled_ones_on_simulated_records():
    """Two images per class of ten classes, true class means spread as much as the noise: the shrunk estimate
    predicts a class's next image better than its own two images' mean or the mean of all (squared error)."""
    gen = torch.Generator().manual_seed(0)
    err = {"shrunk": 0.0, "raw": 0.0, "pooled": 0.0}
    for _ in range(200):
        truth = 50 + 4 * torch.randn(10, generator=gen)
        steps = (truth.repeat_interleave(2) + 4 * torch.randn(20, generator=gen)).tolist()
        conds = [c for c in range(10) for _ in range(2)]
        shrunk = records.per_image_steps(steps, conds, list(range(10)))
        for c in range(10):
            nxt = float(truth[c] + 4 * torch.randn(1, generator=gen))
            err["shrunk"] += (statistics.fmean(shrunk[c]) - nxt) ** 2
            err["raw"] += ((steps[2 * c] + steps[2 * c + 1]) / 2 - nxt) ** 2
            err["pooled"] += (statistics.fmean(steps) - nxt) ** 2
    assert err["shrunk"] < err["raw"] and err["shrunk"] < err["pooled"]


def test_width_interpolation_is_linear_between_measured_widths():
    widths = {"1": {"fixed_s": 1.0, "plans": {"ar": {"step_s": 0.01}, "x": {"step_s": 0.1}}},
              "4": {"fixed_s": 4.0, "plans": {"ar": {"step_s": 0.04}}}}
    mid = calibration.at_width(widths, 2)
    assert mid["fixed_s"] == pytest.approx(2.0) and mid["plans"] == {"ar": {"step_s": pytest.approx(0.02)}}
    assert calibration.at_width(widths, 4) is widths["4"]
    assert calibration.at_width(widths, 7)["fixed_s"] == pytest.approx(7.0)  # extended past the last


def test_a_record_entry_measured_with_other_decode_settings_is_stale():
    plan = candidate_plans(False, False)[1]  # mc-sjd/L4
    record = records.empty_record("model", SAMPLING, "fp32")
    record["plans"][plan.name] = {"steps": [3], "decode": records.decode_settings(plan, SAMPLING)}
    assert records.plan_steps(record, plan, 16) == [3]
    record["plans"][plan.name]["decode"]["initial"] = "last"  # measured before a default changed
    assert records.plan_steps(record, plan, 16) is None
    del record["plans"][plan.name]["decode"]  # a record from before entries said what they measured
    assert records.plan_steps(record, plan, 16) is None


def test_a_dtype_reads_its_own_shipped_record_else_another_dtypes_and_its_cache_over_both():
    """Numerics change acceptance a little, so records are per dtype; a bundle shipping only fp32's still serves
    bf16, and a record measured here for a dtype wins over the shipped one."""
    plan = candidate_plans(False, False)[1]  # mc-sjd/L4

    def record(dtype, steps):
        rec = records.empty_record("model", SAMPLING, dtype)
        rec["plans"][plan.name] = {"steps": steps, "decode": records.decode_settings(plan, SAMPLING)}
        return rec
    shipped = {"bf16": record("bf16", [11]), "fp32": record("fp32", [10])}  # sorted, as a manifest keeps them
    assert records.plan_steps(records.load_record("model", SAMPLING, "bf16", shipped), plan, 16) == [11]
    assert records.plan_steps(records.load_record("model", SAMPLING, "fp16", shipped), plan, 16) == [10]
    assert records.plan_steps(records.load_record("model", SAMPLING, "bf16", {}), plan, 16) is None
    records.save_record(record("bf16", [12]))
    assert records.plan_steps(records.load_record("model", SAMPLING, "bf16", shipped), plan, 16) == [12]
    assert records.plan_steps(records.load_record("model", SAMPLING, "fp32", shipped), plan, 16) == [10]


def test_relaxed_plans_join_only_when_allowed():
    lossless = candidate_plans(True, True)
    assert all(p.lossless for p in lossless) and lossless[0] == AR
    relaxed = candidate_plans(True, True, {m: {} for m in RELAXED_METHODS})
    assert {p.name for p in relaxed if not p.lossless} >= {"lantern", "lantern++/chain-5", "mc-sjd-relaxed/L16"}
    assert not any(p.decode(SAMPLING).needs_drafter for p in candidate_plans(False, True, {"lantern++": {}}))
    validated = candidate_plans(True, True, {"lantern++": {"lam": 2.0}})
    named = {p.name: p for p in validated if not p.lossless}
    assert set(named) == {"lantern++/chain-5@lam=2.0", "lantern++/lantern++-57@lam=2.0"}  # settings in the name
    assert named["lantern++/chain-5@lam=2.0"].decode(SAMPLING).lam == 2.0


@pytest.fixture(autouse=True)
def calm_timing(monkeypatch):
    """These tests pin the cost model and the cache, not the disturbance check (tests/cli/test_faults.py pins it):
    the tiny model's sub-millisecond steps under the parallel suite's load would read as disturbed at random."""
    monkeypatch.setattr(calibration, "disturbance", lambda entry: "")


@pytest.fixture(scope="module")
def pipe(tiny):
    target, drafter, proximity = tiny
    return Pipeline(target, drafter, proximity, backend="cpu")


def seed_calibration(pipe, width: int, step_ms: dict, fixed_s: float = 0.01, skip: str = "",
                     validated: dict | None = None, sampling: SamplingConfig = SAMPLING) -> None:
    """Write a calibration (synthetic, made by the test) for this pipeline: every plan not named costs 1 s per
    step; `skip` is left out (to be measured). validated: a bundle's validations (its plans' names)."""
    key = calibration.pipe_key(pipe, sampling)
    everything = candidate_plans(True, True, allowed_relaxation(True, validated or {}, sampling,
                                                                pipe.config.vocab_size)[0])
    plans = {p.name: {"step_s": step_ms.get(p.name, 1000.0) / 1e3} for p in everything if p.name != skip}
    calibration.save_calibration({"key": key, "widths": {str(width): {"fixed_s": fixed_s, "plans": plans}}})


@pytest.mark.usefixtures("unlimited_deciding")
def test_choice_follows_the_cost_model(pipe):
    """Synthetic step costs: cheap Jacobi wins, a gain below the margin goes to AR, and a relaxed plan needs
    permission."""
    choose(pipe, 2, SAMPLING, batch=2, progress=False)  # measures the acceptance record (and a calibration)
    record = records.load_record(pipe.model_key, SAMPLING, pipe.dtype)
    steps = {name: sum(e["steps"]) / len(e["steps"]) for name, e in record["plans"].items()}
    assert all(s < pipe.config.block_size - 1 for s in steps.values())  # speculation saves steps on the tiny model
    seed_calibration(pipe, 2, {"ar": 1.0, "mc-sjd/L4": 0.5})  # a Jacobi step at half an AR step's cost
    c = choose(pipe, 2, SAMPLING, batch=2, progress=False)
    assert c.plan.name == "mc-sjd/L4" and c.calibrated_s == 0.0 and c.predicted_speedup > 1.0
    row = {r["plan"]: r for r in c.candidates}["mc-sjd/L4"]
    pair = [record["plans"]["mc-sjd/L4"]["steps"]] * 2  # no classes named: each image from all of the record
    assert row["predicted_seconds"] == pytest.approx(0.01 + records.expected_max(pair) * 0.5e-3)
    ratio = (pipe.config.block_size - 1) / records.expected_max(pair)
    inside = (1 + MIN_SPEEDUP) / 2  # faster than AR, but not by the margin
    seed_calibration(pipe, 2, {"ar": 1.0, "mc-sjd/L4": ratio / inside}, fixed_s=0.0)
    kept = choose(pipe, 2, SAMPLING, batch=2, progress=False)
    assert kept.plan == AR  # a gain inside the margin: AR, and it says which plan missed it and by what
    assert f"mc-sjd/L4, was predicted at {inside:.2f}x, under the {MIN_SPEEDUP:.2f}x a plan needs" in kept.summary()
    asked = choose(pipe, 2, SAMPLING, batch=2, progress=False, min_speedup=1.0)  # any predicted gain will do
    assert asked.plan.name == "mc-sjd/L4" and asked.to_dict()["min_speedup"] == 1.0 and "under" not in asked.summary()
    for bad in (0.9, float("nan"), True, "1.5"):
        with pytest.raises(ValueError, match=f"min_speedup {bad!r} is not allowed; allowed: a finite number >= 1"):
            choose(pipe, 2, SAMPLING, batch=2, progress=False, min_speedup=bad)
    chain = "lantern++/chain-5@k=4"  # the preset's k = 10 clipped to 1/16 of the tiny model's 64 codes
    seed_calibration(pipe, 2, {"ar": 1.0, chain: 0.01})
    assert choose(pipe, 2, SAMPLING, batch=2, progress=False).plan == AR  # lossless only by default
    allowed = choose(pipe, 2, SAMPLING, batch=2, allow_relaxed=True, progress=False)
    assert allowed.plan.name == chain and allowed.decode.acceptance == "lantern++" and allowed.decode.k == 4


def test_plans_that_cannot_fit_are_left_out_and_never_prepared(pipe, monkeypatch):
    """Memory for AR at 2 images per step and for nothing wider: auto weighs AR alone, every other plan skipped
    with its refusal as the reason, though the calibration says a Jacobi plan would win; no runner but AR's is
    prepared. They used to be measured and timed at that width first (issue 56)."""
    import lantern.api
    seed_calibration(pipe, 2, {"ar": 1.0, "mc-sjd/L4": 0.5})
    pipe.release()
    available = pipe.predict_peak(AR.decode(SAMPLING), 2).total_bytes
    monkeypatch.setattr(lantern.api, "available_bytes", lambda device: (available, "a test's figure"))
    choice = choose(pipe, 2, SAMPLING, batch=2, progress=False)
    skipped = {r["plan"]: r["skipped"] for r in choice.candidates if "skipped" in r}
    assert choice.plan == AR and "plan mc-sjd/L4 cannot fit" in skipped["mc-sjd/L4"], skipped
    assert all(spec.verify_widths == (1,) for spec in pipe._runners)


def run_on_fakes(monkeypatch) -> None:
    """Calibration's timed runs (lantern.engine.run_batch) on the fake pipelines below: each fake's run_batch."""
    monkeypatch.setattr(calibration, "run_batch",
                        lambda pipe, dcfg, width, conditions, tokens: pipe.run_batch(dcfg, width, tokens))


@pytest.fixture
def fake_engine(monkeypatch):
    run_on_fakes(monkeypatch)


class CostCurvePipe:
    """A fake pipeline (made by this test, no model) with a fake engine (run_on_fakes): a loop step costs
    step_ms(verify width, drafts?) milliseconds and speculation halves the steps. Records which verify widths ran."""

    def __init__(self, step_ms, block: int = 64):
        self.config = SimpleNamespace(block_size=block, model_type="c2i", num_classes=10)
        self.step_ms, self.ran, self.floors = step_ms, Counter(), {}
        self.now = 0.0  # a fake clock: every generation advances it by its wall time

    def clock(self) -> float:
        return self.now

    def runner(self, dcfg, width):
        def attend_at_least(slots):  # no attention to trim: only recorded
            self.floors.setdefault(dcfg.verify_width, set()).add(slots)
            return contextlib.nullcontext()
        return SimpleNamespace(spec=SimpleNamespace(prefix_len=1), attend_at_least=attend_at_least,
                               fused_steps=lambda: None)  # a runner without a fused step

    def run_batch(self, dcfg, batch, tokens):
        w = 1 if dcfg.strategy is None else dcfg.strategy.verify_width
        self.ran[w] += 1
        steps = tokens if w == 1 else max(1, tokens // 2)
        image = SimpleNamespace(target_forwards=steps + 1)
        wall = 1e-3 * (1 + steps * self.step_ms(w, dcfg.needs_drafter))
        self.now += wall
        return SimpleNamespace(stats=SimpleNamespace(wall_seconds=wall, images=[image] * batch))


def calibrate(pipe):
    plans = candidate_plans(True, False)
    per_image = {p.name: (63.0 if p == AR else 31.5) for p in plans}
    entry = calibration.measure_width(pipe, plans, SAMPLING, 1, per_image, progress=False)
    widths = {p.name: p.decode(SAMPLING).verify_width for p in plans}
    return plans, entry, widths, {name for name, v in entry["plans"].items() if v.get("lower_bound")}


def test_each_plan_is_timed_at_the_width_its_chunk_attends(fake_engine):
    pipe = CostCurvePipe(lambda width, drafts: 1.0)
    plans = [AR, next(p for p in candidate_plans(True, False) if p.name == "mc-sjd/L4")]
    calibration.measure_width(pipe, plans, SAMPLING, 4, {"ar": 63.0, "mc-sjd/L4": 31.5}, progress=False,
                              attended={"mc-sjd/L4": 0.75})
    # prefix 1 + the attended part of the 64-token image + the verify width; AR at the middle
    assert pipe.floors == {1: {1 + 32 + 1}, 5: {1 + 48 + 5}}


def test_calibration_stays_inside_its_budget(monkeypatch, fake_engine):
    """Steps of a quarter of a second (a slow machine): every run must be expected to fit before it starts,
    so the timing ends inside BUDGET_S, where unbounded it takes more than five times as long; round 1 keeps
    the wide plans that no longer fit as floors, and the rounds stop early."""
    plans = candidate_plans(True, False)
    per_chunk = {p.name: (63.0 if p == AR else 31.5) for p in plans}

    def calibrate_slow():
        pipe = CostCurvePipe(lambda width, drafts: 250.0 * (1 + width / 16))
        entry = calibration.measure_width(pipe, plans, SAMPLING, 1, per_chunk, progress=False, clock=pipe.clock)
        assert entry["seconds"] == pipe.now  # nothing to prepare in the fake
        return entry, {name: len(v.get("ratio_to_ar", [])) for name, v in entry["plans"].items()}

    budget = calibration.BUDGET_S
    entry, runs = calibrate_slow()
    assert entry["seconds"] <= budget and runs["ar"] >= 1
    monkeypatch.setattr(calibration, "BUDGET_S", math.inf)
    unbounded, unbounded_runs = calibrate_slow()
    assert unbounded["seconds"] > 5 * budget
    assert {n for n, k in runs.items() if k == 0} > {n for n, k in unbounded_runs.items() if k == 0}
    assert max(runs.values()) < max(unbounded_runs.values()) == calibration.MAX_ROUNDS


def test_plans_that_cannot_contend_are_bounded_not_timed(fake_engine):
    pipe = CostCurvePipe(lambda width, drafts: float(width))  # a steep verify curve
    plans, entry, widths, bounded = calibrate(pipe)
    # at AR's step cost halving the steps would win, so the narrowest plan (width 5) is timed; its step cost
    # then rules out every wider plan
    assert bounded == {p.name for p in plans} - {"ar", "mc-sjd/L4"}
    assert all(widths[name] not in pipe.ran for name in bounded)  # never run
    for name in bounded:  # the floor is the widest timed plan not wider than it
        assert entry["plans"][name]["step_s"] < widths[name] * 1e-3
    assert entry["prepare_s"] >= 0 and entry["seconds"] > 0


def test_extra_rounds_go_to_the_close_race(fake_engine):
    """L4 and L8 within 5% of each other, every other plan 30% behind: rounds past ROUNDS time only L4 and L8;
    with L8 30% behind too, only L4."""
    costs = {1: 1.0, 5: 1.0, 9: 1.05}
    pipe = CostCurvePipe(lambda width, drafts: costs.get(width, 1.3))
    plans, entry, widths, bounded = calibrate(pipe)
    assert len(entry["plans"]["mc-sjd/L4"]["ratio_to_ar"]) == len(entry["plans"]["mc-sjd/L8"]["ratio_to_ar"]) \
        == calibration.MAX_ROUNDS
    assert len(entry["plans"]["exact/chain-5"]["ratio_to_ar"]) == calibration.ROUNDS  # a contender, not close
    costs[9] = 1.3  # L4 leads alone: its estimate still gets every extra round
    plans, entry, widths, bounded = calibrate(CostCurvePipe(lambda width, drafts: costs.get(width, 1.3)))
    rounds = {name: len(v["ratio_to_ar"]) for name, v in entry["plans"].items() if "ratio_to_ar" in v}
    assert rounds["mc-sjd/L4"] == calibration.MAX_ROUNDS
    assert rounds["mc-sjd/L8"] == rounds["exact/chain-5"] == calibration.ROUNDS


def test_a_costly_drafter_bounds_no_plan_that_drafts_nothing(fake_engine):
    pipe = CostCurvePipe(lambda width, drafts: 1 + 0.02 * width + (50.0 if drafts else 0.0))  # drafting dominates
    plans, entry, widths, bounded = calibrate(pipe)
    assert not any(name.startswith("mc-sjd") for name in bounded)
    per_image = {name: v["step_s"] * (63.0 if name == "ar" else 31.5) for name, v in entry["plans"].items()}
    assert min(per_image, key=per_image.get).startswith("mc-sjd")


class FlatteringPipe(CostCurvePipe):
    """A noisy machine (a fake): the first run of each listed verify width reads `by` times too fast."""

    def __init__(self, step_ms, flattered: dict):
        super().__init__(step_ms)
        self.flattered = dict(flattered)

    def run_batch(self, dcfg, batch, tokens):
        w = 1 if dcfg.strategy is None else dcfg.strategy.verify_width
        out = super().run_batch(dcfg, batch, tokens)
        if tokens > 2 and w in self.flattered:  # a timed run, not a warm-up
            wall = out.stats.wall_seconds
            out.stats.wall_seconds = wall / self.flattered.pop(w)
            self.now -= wall - out.stats.wall_seconds
        return out


def probe(pipe, plans, budget: float) -> dict:
    per_chunk = {p.name: (63.0 if p == AR else 31.5) for p in plans}
    return calibration.measure_width(pipe, plans, SAMPLING, 1, per_chunk, progress=False, clock=pipe.clock,
                                     rounds=1, max_rounds=3, budget=budget)


@pytest.mark.usefixtures("unlimited_deciding")
def test_a_calibration_holds_for_the_sampling_cost_it_was_measured_at(pipe, monkeypatch):
    """A step at the whole vocabulary costs more than at top-k 5 (a sort and an acceptance over every code): the
    calibration made at the bundle's top-k 5 is not read at LlamaGen's whole-vocabulary sampling, which measures
    its own; what costs nothing (temperature, the CFG scale's value, a top-k past the vocabulary) shares one."""
    vocab = pipe.config.vocab_size
    whole = SamplingConfig(temperature=1.0, top_k=0, cfg_scale=2.0)
    assert calibration.pipe_key(pipe, whole) != calibration.pipe_key(pipe, SAMPLING)
    assert calibration.pipe_key(pipe, SamplingConfig(temperature=0.7, top_k=vocab + 5, cfg_scale=4.0)) == \
        calibration.pipe_key(pipe, whole)
    assert calibration.pipe_key(pipe, SamplingConfig(top_k=5, cfg_scale=1.0)) != calibration.pipe_key(pipe, SAMPLING)
    seed_calibration(pipe, 2, {"ar": 1.0, "mc-sjd/L4": 0.5})  # at SAMPLING
    measured = []
    real = calibration.measure_width
    monkeypatch.setattr(calibration, "measure_width", lambda *a, **k: measured.append(a[2]) or real(*a, **k))
    choose(pipe, 2, SAMPLING, batch=2, progress=False)
    assert not measured  # its own sampling: cached
    choose(pipe, 2, whole, batch=2, progress=False)
    assert measured and all(s == whole for s in measured)


@pytest.mark.usefixtures("unlimited_deciding")
def test_a_plan_timed_too_few_times_is_never_chosen(pipe):
    """One run of a few steps can read a plan 2x too fast (a probe on an Intel Xeon VM timed MC-SJD's step at
    1.19x AR's where whole runs take 1.7-1.8x, and the default ran at 0.95x AR): it is shown, never chosen."""
    choose(pipe, 2, SAMPLING, batch=2, progress=False)
    seed_calibration(pipe, 2, {"ar": 1.0, "mc-sjd/L4": 0.5})
    key = calibration.pipe_key(pipe, SAMPLING)
    data = calibration.load_calibration(key)
    data["widths"]["2"]["plans"]["mc-sjd/L4"]["unconfirmed"] = True
    calibration.save_calibration(data)
    c = choose(pipe, 2, SAMPLING, batch=2, progress=False)
    row = {r["plan"]: r for r in c.candidates}["mc-sjd/L4"]
    assert c.plan == AR and row["unconfirmed"] and row["predicted_speedup"] > MIN_SPEEDUP
    assert f"from fewer than {calibration.CONFIRMED} timed runs" in c.summary()


def test_a_probe_out_of_budget_leaves_its_flattered_leader_unconfirmed(fake_engine):
    """L4's step truly costs 2.2 AR steps (0.9x AR at half the steps); its one run in round 1 reads 2x too fast.
    With no budget left to time it again it must not be taken at its word."""
    plans = [AR, next(p for p in candidate_plans(True, False) if p.name == "mc-sjd/L4")]
    costs = {1: 1.0, 5: 2.2}
    entry = probe(FlatteringPipe(lambda w, drafts: costs[w], {5: 2.0}), plans, budget=0.06)
    l4 = entry["plans"]["mc-sjd/L4"]
    assert len(l4["ratio_to_ar"]) < calibration.CONFIRMED and l4["unconfirmed"]
    assert l4["step_s"] < entry["plans"]["ar"]["step_s"] * 1.25  # what the flattered run says ...
    # ... with the budget to confirm it, the median of its runs is its true cost, and it is confirmed
    confirmed = probe(FlatteringPipe(lambda w, drafts: costs[w], {5: 2.0}), plans, budget=math.inf)
    l4 = confirmed["plans"]["mc-sjd/L4"]
    assert len(l4["ratio_to_ar"]) == calibration.CONFIRMED and "unconfirmed" not in l4
    assert l4["step_s"] / confirmed["plans"]["ar"]["step_s"] == pytest.approx(2.2, rel=0.1)


def test_round_one_leaves_the_budget_to_confirm_its_leader(fake_engine):
    """Every plan's first run fits the budget, and then nothing more would: round 1 stops timing new plans
    (kept as floors) while confirming the leader still fits, so the plan the choice hinges on is timed
    CONFIRMED times."""
    plans = candidate_plans(True, False)
    def flat():  # a flat verify curve: every plan contends
        return CostCurvePipe(lambda w, drafts: 1.0 + 0.01 * w)
    per_chunk = {p.name: (63.0 if p == AR else 31.5) for p in plans}
    first = flat()
    round_one = calibration.measure_width(first, plans, SAMPLING, 1, per_chunk, progress=False, rounds=1,
                                          max_rounds=1, budget=math.inf, clock=first.clock)
    assert all("ratio_to_ar" in v for v in round_one["plans"].values())
    pipe = flat()
    entry = probe(pipe, plans, budget=1.05 * round_one["seconds"])
    timed = {name: len(v["ratio_to_ar"]) for name, v in entry["plans"].items() if "ratio_to_ar" in v}
    leader = min((n for n in timed if n != "ar"), key=lambda n: entry["plans"][n]["step_s"] * 31.5)
    assert timed[leader] == calibration.CONFIRMED and len(timed) < len(plans)


def test_ar_costs_the_median_of_every_ar_run_not_its_own_ratio(fake_engine):
    """AR is its own reference: its one run as a plan reading 1.5x slow must not move its cost (a probe once
    put AR at 1.41x its own reference, which made a plan timed against it look faster than it is)."""
    plans = [AR, next(p for p in candidate_plans(True, False) if p.name == "mc-sjd/L4")]
    pipe = CostCurvePipe(lambda w, drafts: 1.0 + 0.2 * (w > 1))
    timed_ar = []

    def run_batch(dcfg, batch, tokens, base=pipe.run_batch):
        out = base(dcfg, batch, tokens)
        if dcfg.strategy is None and tokens > 2:
            timed_ar.append(tokens)
            if len(timed_ar) == 2:  # AR's own run as a plan (the first is its reference)
                pipe.now += out.stats.wall_seconds / 2
                out.stats.wall_seconds *= 1.5
        return out
    pipe.run_batch = run_batch
    entry = probe(pipe, plans, budget=math.inf)
    assert max(entry["plans"]["ar"]["ratio_to_ar"]) > 1.4  # the slow run was AR's own
    assert entry["plans"]["ar"]["step_s"] == pytest.approx(statistics.median(entry["ar_reference_s"]), rel=0.05)


@pytest.mark.usefixtures("unlimited_deciding")
def test_the_choice_follows_the_requested_classes(pipe, tmp_path, monkeypatch):
    """A record where L4 is fast on class 0 and slow on class 1, L8 the same on both: equal step costs, so
    class 0 images get L4 and class 1 images L8."""
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(tmp_path))  # the synthetic record stays in this test
    choose(pipe, 2, SAMPLING, batch=2, progress=False)
    record = records.load_record(pipe.model_key, SAMPLING, pipe.dtype)
    for name, steps in (("mc-sjd/L4", [4, 5, 4, 5, 40, 41, 40, 41]), ("mc-sjd/L8", [20, 21] * 4)):
        record["plans"][name].update(steps=steps, conditions=[0, 0, 0, 0, 1, 1, 1, 1])
    records.save_record(record)
    seed_calibration(pipe, 2, {"ar": 10.0, "mc-sjd/L4": 1.0, "mc-sjd/L8": 1.0})
    assert choose(pipe, 2, SAMPLING, batch=2, progress=False, classes=[0, 0]).plan.name == "mc-sjd/L4"
    assert choose(pipe, 2, SAMPLING, batch=2, progress=False, classes=[1, 1]).plan.name == "mc-sjd/L8"
    with pytest.raises(ValueError, match="3 class ids given for 2 images"):
        choose(pipe, 2, SAMPLING, batch=2, progress=False, classes=[0, 1, 2])


@pytest.mark.usefixtures("unlimited_deciding")
def test_a_lower_bound_is_never_chosen(pipe):
    choose(pipe, 2, SAMPLING, batch=2, progress=False)
    seed_calibration(pipe, 2, {"ar": 1.0, "mc-sjd/L4": 0.5})
    key = calibration.pipe_key(pipe, SAMPLING)
    data = calibration.load_calibration(key)
    data["widths"]["2"]["plans"]["mc-sjd/L8"] = {"step_s": 1e-6, "lower_bound": True}
    calibration.save_calibration(data)
    c = choose(pipe, 2, SAMPLING, batch=2, progress=False)
    assert c.plan.name == "mc-sjd/L4"
    assert {r["plan"]: r for r in c.candidates}["mc-sjd/L8"]["lower_bound"]


@pytest.mark.usefixtures("unlimited_deciding")
def test_calibration_is_measured_once_and_cached(pipe, tmp_path, monkeypatch):
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(tmp_path))
    first = choose(pipe, 3, SAMPLING, batch=2, progress=False)
    assert first.calibrated_s > 0 and first.width == 2
    files = sorted(p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*.json"))
    assert files == ["calibration", "records"]
    again = choose(pipe, 3, SAMPLING, batch=2, progress=False)
    assert again.calibrated_s == 0.0 and again.plan == first.plan
    entry = json.loads(next((tmp_path / "calibration").glob("*.json")).read_text())["widths"]["2"]
    assert entry["fixed_s"] > 0 and all(v["step_s"] > 0 for v in entry["plans"].values())
    result = pipe.generate([0, 1, 2], first.decode, batch=first.width)
    assert result.tokens.shape == (3, pipe.config.block_size)


@pytest.mark.usefixtures("unlimited_deciding")
def test_the_planner_times_the_engine_not_the_public_api(pipe, tmp_path, monkeypatch):
    """Acceptance records and calibration runs go to the engine (lantern.engine.run_batch), never back through
    Pipeline.generate: on a cold cache a plan is chosen with generate out of order."""
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(tmp_path))

    def refused(*args, **kwargs):
        raise AssertionError("the planner called Pipeline.generate")
    monkeypatch.setattr(Pipeline, "generate", refused)
    measured = choose(pipe, 1, SAMPLING, batch=1, progress=False)
    assert measured.calibrated_s > 0 and records.load_record(pipe.model_key, SAMPLING, pipe.dtype)["plans"]


def test_a_corrupt_cache_entry_is_measured_again(pipe, tmp_path, monkeypatch):
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(tmp_path))
    choose(pipe, 1, SAMPLING, batch=1, progress=False)
    for path in tmp_path.rglob("*.json"):
        path.write_text("{not json")
    assert choose(pipe, 1, SAMPLING, batch=1, progress=False).calibrated_s > 0


def lantern(*args, env=None):
    return subprocess.run([sys.executable, "-m", "lantern.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("args, message", [
    (["--window", "8"], "--method auto chooses --window itself"),
    (["--method", "ar", "--allow-relaxed"], "--allow-relaxed is an option of --method auto"),
    (["--method", "mc-sjd", "--min-speedup", "1.1"], "--min-speedup is an option of --method auto"),
    (["--min-speedup", "0.9"], "argument --min-speedup: 0.9 is not allowed; allowed: a finite number >= 1"),
])
def test_flags_auto_decides_are_refused_before_any_work(tmp_path, capsys, args, message):
    """In process (test_cli.py sees a subprocess's exit code 2)."""
    from lantern.cli import main
    assert main(["generate", "--out", str(tmp_path / "o"), *args, "--json"]) == 2
    assert message in json.loads(capsys.readouterr().out)["error"]
    assert not (tmp_path / "o").exists()


def test_generate_auto_runs_the_plan_it_reports(tiny):
    target, drafter, proximity = tiny
    pipe = Pipeline(target, drafter, proximity, backend="cpu", defaults=ModelDefaults(sampling=SAMPLING))
    result = pipe.generate([1, 2, 3], "auto", seed=5, batch=2)
    assert result.plan is not None and result.plan.width == 2 and result.decode == result.plan.decode
    again = pipe.generate([1, 2, 3], result.plan.decode, seed=5, batch=2)
    assert torch.equal(result.tokens, again.tokens)  # same plan, same seed: the same tokens
    with pytest.raises(ValueError, match="Pipeline.plan"):
        method_preset("auto", SAMPLING)
    with pytest.raises(ValueError, match="needs sampling settings"):
        Pipeline(target, drafter, proximity, backend="cpu").generate([1], "auto")


@pytest.mark.slow
def test_cli_reports_the_plan_and_says_it_calibrates(tmp_path, monkeypatch, capsys):
    """The embedded model (it ships its acceptance record), its calibration seeded by the test at 1 s a step for
    every plan but MC-SJD L=4, which the first run (a process of its own) calibrates and says so on stderr. The
    plan it reports is the one its candidates' predictions choose, each prediction recomputed here from the
    calibration it stored (the measured plan's cost is this machine's, so the test does not know the winner); the
    second run (in process) measures nothing and chooses the same."""
    from lantern.bundle import load_bundle
    from lantern.cli import main
    bundle = load_bundle()
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(tmp_path / "cache"))  # the subprocess inherits it
    monkeypatch.setenv("LANTERN_BACKEND", "")
    pipe = Pipeline.from_bundle(bundle, backend="cpu")
    sampling = SamplingConfig(**bundle.default_sampling)
    seed_calibration(pipe, 1, {}, skip="mc-sjd/L4", validated=bundle.validations, sampling=sampling)
    argv = ["generate", "--classes", "3", "--no-images", "--json"]
    run = lantern(*argv)
    assert run.returncode == 0, run.stderr
    capsys.readouterr()
    assert main(argv) == 0
    again = capsys.readouterr()
    first, second = json.loads(run.stdout), json.loads(again.out)
    assert "calibrating 1 plan(s) on cpu (fp32) at 1 image(s) per step" in run.stderr
    assert "calibrating" not in again.err and "measuring the acceptance" not in run.stderr
    plan = first["plan"]
    assert first["mode"] == "auto" and plan["batch"] == 1
    assert plan["calibration_seconds"] > 0 and plan["measured_seconds"] == first["wall_seconds"]
    stored = calibration.load_calibration(calibration.pipe_key(pipe, sampling))["widths"]["1"]
    rows = {c["plan"]: c for c in plan["candidates"] if "predicted_seconds" in c}
    assert {"ar", "mc-sjd/L4", "mc-sjd/L16", "eagle2", "exact/chain-5"} <= set(rows)
    assert stored["plans"]["mc-sjd/L4"]["step_s"] not in (1.0, None)  # measured by the first run, and stored
    for name, row in rows.items():  # one image: the fixed cost and its mean steps at the stored step cost
        step_s = stored["plans"][name]["step_s"]
        assert row["step_ms"] == pytest.approx(1e3 * step_s)
        assert row["predicted_seconds"] == pytest.approx(stored["fixed_s"] + row["steps_per_image"] * step_s)
    choosable = [r for r in rows.values() if not r.get("lower_bound") and not r.get("unconfirmed")]
    best = min(choosable, key=lambda r: r["predicted_seconds"])
    if rows["ar"]["predicted_seconds"] / best["predicted_seconds"] < MIN_SPEEDUP:
        best = rows["ar"]
    assert plan["plan"] == best["plan"] and plan["predicted_seconds"] == pytest.approx(best["predicted_seconds"])
    assert second["plan"]["plan"] == plan["plan"] and second["plan"]["calibration_seconds"] == 0.0
    # no backend pinned: auto weighed the modes; compiled and fused were never prepared here, and their prior
    # compile costs are more than this sub-second request, so it stays eager and says why, against the fastest AR
    # it knows
    assert plan["backend"] == "cpu" and plan["mode"] == "eager" and plan["fastest_ar"]["backend"] == "cpu"
    assert plan["fused_step"] is False
    modes = {(row["backend"], row["mode"]): row for row in plan["backends"]}
    assert modes["cpu", "eager"]["status"] == "weighed"
    assert modes["cpu-graph", "compiled"]["status"].startswith("not calibrated")
    fused = modes["cpu-graph", "fused"]
    assert fused["fused_step"] and fused["status"].startswith("not calibrated")
    assert "fastest AR, cpu (eager)" in plan["why"]
