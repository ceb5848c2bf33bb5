"""What `--method auto` may spend measuring before it generates (lantern.plan.deciding): a share of the request's
predicted AR seconds, banked across requests; what it does not cover waits, and `measure_all` measures it all.
(The rest of the suite runs with the share unlimited, as auto decided before the credit: tests/conftest.py.)"""
import pytest

from conftest import make_models
from lantern.api import ModelDefaults, Pipeline
from lantern.decoding.sampling import SamplingConfig
from lantern.models.config import GPTConfig
from lantern.plan import calibration, choose as choose_mod, deciding
from lantern.plan.candidates import AR
from lantern.plan.choose import WAITING, choose

SAMPLING = SamplingConfig(temperature=1.0, top_k=5, cfg_scale=2.0)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache (no acceptance record, no calibration) and the tiny model's pipeline on cpu."""
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "disturbance", lambda entry: "")  # sub-millisecond steps under load
    cfg = GPTConfig(dim=32, n_layer=1, n_head=2, vocab_size=32, num_classes=4, block_size=16, multiple_of=16)
    target, drafter, proximity = make_models(cfg, seed=3)
    return Pipeline(target, drafter, proximity, backend="cpu", defaults=ModelDefaults(sampling=SAMPLING))


@pytest.fixture
def work(monkeypatch):
    """Counts what deciding generates: acceptance-record runs (whole images) and calibration's timed runs."""
    counts = {"record_runs": 0, "timed_runs": 0}
    real_batch, real_short = choose_mod.run_batch, calibration._short_run

    def record_run(*args, **kwargs):
        counts["record_runs"] += 1
        return real_batch(*args, **kwargs)

    def timed_run(*args, **kwargs):
        counts["timed_runs"] += 1
        return real_short(*args, **kwargs)
    monkeypatch.setattr(choose_mod, "run_batch", record_run)
    monkeypatch.setattr(calibration, "_short_run", timed_run)
    return counts


def banked(pipe) -> float:
    key = calibration.pipe_key(pipe, SAMPLING)
    return calibration.load_calibration(key).get(deciding.CREDIT, 0.0)


def test_a_request_that_cannot_pay_measures_nothing_but_a_quick_ar_and_runs_ar(fresh, work, monkeypatch):
    monkeypatch.setenv(deciding.SHARE_ENV, "0")
    choice = choose(fresh, 1, SAMPLING, batch=1, progress=False)
    assert work["record_runs"] == 0  # the old auto measured every plan's acceptance here (4 images each)
    assert work["timed_runs"] <= 2 + calibration.FIXED_REPEATS  # AR warmed, its fixed cost, one short run
    assert choice.plan == AR
    waiting = [r["plan"] for r in choice.candidates if r.get("skipped") == WAITING]
    assert len(waiting) >= 5 and AR.name not in waiting
    assert "plan(s) not measured here yet wait" in choice.summary()
    # stderr's line: the decision once, the advice once, no relaxation account (that is --json's)
    line = choice.line()
    assert line.startswith("auto chose ar") and line.count("`lantern profile calibrate`") == 1, line
    assert f"{len(waiting)} plan(s) not measured here yet" in line and len(line) < 160 and "relax" not in line, line
    # the quick estimate is cached: the next such request times nothing at all
    work["timed_runs"] = 0
    assert choose(fresh, 1, SAMPLING, batch=1, progress=False).plan == AR and work["timed_runs"] == 0


def test_each_request_banks_its_share_and_a_banked_credit_pays_for_measuring(fresh, work, monkeypatch):
    monkeypatch.setenv(deciding.SHARE_ENV, "0.25")
    first = choose(fresh, 1, SAMPLING, batch=1, progress=False)
    # the tiny model's one-image request cannot pay for a record: its share is banked, less the quick AR timing
    assert work["record_runs"] == 0
    assert banked(fresh) == pytest.approx(0.25 * first.predicted_ar_s - first.calibrated_s, rel=0.05, abs=1e-4)
    assert first.deciding["share"] == 0.25 and first.deciding["left_s"] == pytest.approx(banked(fresh))
    second = choose(fresh, 1, SAMPLING, batch=1, progress=False)
    assert banked(fresh) == pytest.approx(second.deciding["banked_s"] + 0.25 * second.predicted_ar_s, rel=0.05)
    # a credit banked by many requests (here written as if) pays: records, then the probe, and the rest is kept
    key = calibration.pipe_key(fresh, SAMPLING)
    data = calibration.load_calibration(key)
    data[deciding.CREDIT] = 1e6
    calibration.save_calibration(data)
    paid = choose(fresh, 1, SAMPLING, batch=1, progress=False)
    assert work["record_runs"] > 0 and "first-run probe" not in paid.cost_source  # 1e6 s covers full rounds
    assert not [r for r in paid.candidates if r.get("skipped") == WAITING]
    assert banked(fresh) == pytest.approx(calibration.budget_s())  # at most one full calibration is banked


def test_a_debt_is_repaid_before_anything_more_is_measured(fresh, work, monkeypatch):
    monkeypatch.setenv(deciding.SHARE_ENV, "1")
    key = calibration.pipe_key(fresh, SAMPLING)
    choose(fresh, 1, SAMPLING, batch=1, progress=False)  # the quick AR estimate, cached
    data = calibration.load_calibration(key)
    data[deciding.CREDIT] = -1e6
    calibration.save_calibration(data)
    work["record_runs"] = 0
    choice = choose(fresh, 1, SAMPLING, batch=1, progress=False)
    assert work["record_runs"] == 0 and choice.plan == AR
    assert banked(fresh) == pytest.approx(-1e6 + choice.predicted_ar_s, abs=1e-3)


def test_measure_all_measures_whatever_the_share(fresh, work, monkeypatch):
    monkeypatch.setenv(deciding.SHARE_ENV, "0")
    choice = choose(fresh, 1, SAMPLING, batch=1, progress=False, measure_all=True)
    assert work["record_runs"] > 0 and not [r for r in choice.candidates if r.get("skipped") == WAITING]
    assert choice.deciding["share"] is None and choice.deciding["left_s"] is None
    assert banked(fresh) == 0.0  # an unlimited credit banks nothing


@pytest.mark.parametrize("text", ["-1", "lots", "nan"])
def test_a_bad_share_is_refused_naming_it(monkeypatch, text):
    monkeypatch.setenv(deciding.SHARE_ENV, text)
    with pytest.raises(ValueError, match=f"{deciding.SHARE_ENV}={text!r} is not allowed; allowed: a number >= 0"):
        deciding.share()


def test_a_bad_share_exits_2_before_generating(tmp_path, capsys, monkeypatch):
    import json
    from lantern.cli import main
    monkeypatch.setenv(deciding.SHARE_ENV, "-0.5")
    out_dir = tmp_path / "out"
    assert main(["generate", "--classes", "1", "--out", str(out_dir), "--json"]) == 2
    assert f"{deciding.SHARE_ENV}='-0.5' is not allowed" in json.loads(capsys.readouterr().out)["error"]
    assert not out_dir.exists()
