"""`--method auto`: predict each candidate plan's wall time for the request, pick the fastest.

For n images decoded `width` at a time, T(plan) = sum over chunks of fixed_s + E[max over the chunk's real images of
steps] * step_s(plan) (cost_model.predict_seconds): fixed_s and step_s from the latency calibration at that width
(calibration.py, or a hardware profile's results), the steps per image from the model's acceptance record
(acceptance_records.py; AR: block - 1), each image's from its own class's where the request names classes. A
speculative plan must be predicted at least min_speedup (MIN_SPEEDUP unless the caller says) times faster than AR,
or AR is chosen: a default slower than AR is a bug.
"""
from __future__ import annotations

import math
import numbers
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from lantern.decoding.config import DecodeConfig
from lantern.decoding.sampling import SamplingConfig
from lantern.engine import run_batch
from lantern.plan import calibration, deciding, acceptance_records as records
from lantern.plan.candidates import AR, Plan, candidate_plans
from lantern.plan.cost_model import predict_seconds
from lantern.plan.host import PlanHost
from lantern.plan.validated import allowed_relaxations
from lantern.files.user_cache import usable_root

MIN_SPEEDUP = 1.25  # a speculative plan must be predicted this much faster than AR: a prediction within 20% of
# the measured speed-up (what auto is held to; on a 2-core VM whose wide steps have two speeds, misses reach 24%)
# then still measures at least 1.0x, as 1.25 * (1 - 0.2) = 1. Hardware that times steadily can ask for less.
SERVICE_HORIZON = 4096  # the images a service weighs auto's one-time costs (calibration, compiles) over: its life,
# not one request (under an hour of full load of the embedded model on 2 CPU cores); a command and Pipeline.plan
# weigh them over the request's own images
LINE_MAX = 160  # characters of the decision's one stderr line (Choice.line)
PROFILE_SCOPE = "hardware profile "  # a Choice's scope when a hardware profile's backend and calibration decided
RECORD_IMAGES = 4  # images per plan when an acceptance record must be measured here
WAITING = ("waits: not yet measured here at this sampling (acceptance or step cost); later requests measure it "
           "with their share of deciding, `lantern profile calibrate` now")
PLAN_STEP = 2.0  # a plan's step in AR steps, to expect what timing it costs (a wide verify costs more on a CPU)
# The first-run probe: every plan timed once (measure_width's round 1), then the leader and any plan within
# calibration.CLOSE of it twice more (one run per plan made the plan its noise flattered most the winner: an Intel
# Xeon VM's probe timed a relaxed 57-node tree's step at 0.58x its exact twin's, predicted 2.28x and measured
# 0.86x), in at most 6 s of timing (runners' preparation apart: a few seconds for eager ones; less when
# $LANTERN_CALIBRATION_BUDGET is less), so a cold machine decides within about 10 s.
PROBE_ROUNDS = dict(rounds=1, max_rounds=3, budget=6.0)


def probe_rounds() -> dict:
    """measure_width's arguments for a first-run probe: PROBE_ROUNDS, its budget no more than budget_s()."""
    return {**PROBE_ROUNDS, "budget": min(PROBE_ROUNDS["budget"], calibration.budget_s())}


@dataclass
class Choice:
    """What `--method auto` chose: the pipeline it runs on, the plan there, its predictions; with the modes weighed
    (lantern.plan.backend_choice) the fastest AR, the one-time cost and every mode's row, else `scope` says why not."""
    plan: Plan
    decode: DecodeConfig
    width: int  # images per static step
    predicted_s: float  # the plan's generation seconds (prepare_s apart)
    predicted_ar_s: float
    candidates: list = field(default_factory=list)  # every plan's prediction
    cost_source: str = ""
    relaxed: str = ""  # which relaxed methods were allowed, and why
    min_speedup: float = MIN_SPEEDUP  # what a plan had to be predicted at to be chosen over AR
    calibrated_s: float = 0.0  # seconds spent measuring for this choice, every mode's (0 when everything was cached)
    prepared_s: float = 0.0  # seconds preparing runners (exporting graphs) to calibrate: later runs reuse them
    disturbed: str = ""  # why the calibration's timing was disturbed (then AR alone is trusted), or ''
    pipeline: object = None  # the Pipeline it runs on (the runner calibration prepared is kept)
    mode: str = ""  # eager, compiled, fused (compiled, the whole step as one graph), onnx, graphs
    scope: str = "pinned"  # planned on one backend: why (pinned, a hardware profile's calibration, a model family)
    baseline: Optional[dict] = None  # modes weighed: the fastest AR (backend, mode, predicted_seconds, prepare in)
    prepare_s: float = 0.0  # modes weighed: the one-time cost counted against the request, and its source
    prepare_source: str = ""
    backends: list = field(default_factory=list)  # modes weighed: every mode's predictions, or why not weighed
    deciding: dict = field(default_factory=dict)  # the request's deciding credit (lantern.plan.deciding.Credit)

    @property
    def predicted_speedup(self) -> float:
        return self.predicted_ar_s / self.predicted_s if self.predicted_s else 1.0

    @property
    def backend(self) -> str:
        return self.pipeline.backend.name

    @property
    def fused_step(self) -> bool:
        return self.mode == "fused"

    @property
    def predicted_total_s(self) -> float:
        return self.prepare_s + self.predicted_s

    @property
    def speedup_over_fastest_ar(self) -> float:
        return self.baseline["predicted_seconds"] / self.predicted_total_s if self.predicted_total_s else 1.0

    @property
    def why(self) -> str:
        if self.baseline is None:
            return f"{self.plan.name} on {self.backend} ({self.scope})"
        b = self.baseline
        out = (f"{self.plan.name} on {self.backend} ({self.mode}): predicted {self.predicted_total_s:.2f} s "
               f"({self.prepare_s:.1f} s of it preparing: {self.prepare_source}), "
               f"{self.speedup_over_fastest_ar:.2f}x the fastest AR, {b['backend']} ({b['mode']}) at "
               f"{b['predicted_seconds']:.2f} s")
        unweighed = [r for r in self.backends if r.get("status") != "weighed"]
        if unweighed:
            out += "; not weighed: " + "; ".join(f"{r['backend']} ({r['mode']}: {r['status']})" for r in unweighed)
        return out

    def to_dict(self) -> dict:
        """The --json plan; with the modes weighed also which backend and mode, and why."""
        out = {"method": self.plan.method, "plan": self.plan.name, **{k: v for k, v in self.plan.describe().items()
                                                                       if k not in ("name", "method")},
               "batch": self.width, "predicted_seconds": self.predicted_s, "predicted_ar_seconds":
               self.predicted_ar_s, "predicted_speedup": self.predicted_speedup, "cost_source": self.cost_source,
               "relaxation": self.relaxed, "min_speedup": self.min_speedup, "calibration_seconds": self.calibrated_s,
               "calibration_prepare_seconds": self.prepared_s, "deciding": self.deciding,
               "candidates": self.candidates}
        if self.baseline is None:
            return out
        return {**out, "backend": self.backend, "mode": self.mode, "fused_step": self.fused_step, "why": self.why,
                "predicted_total_seconds": self.predicted_total_s, "prepare_seconds": self.prepare_s,
                "prepare_source": self.prepare_source, "fastest_ar": self.baseline,
                "speedup_over_fastest_ar": self.speedup_over_fastest_ar, "backends": self.backends}

    def summary(self) -> str:
        if self.baseline is not None:
            return f"auto chose {self.why}{self.waiting()} ({self.cost_source}; {self.relaxed})"
        return (f"auto chose {self.plan.name} at {self.width} image(s) per step: predicted {self.predicted_s:.2f} s, "
                f"{self.predicted_speedup:.2f}x AR{self.why_ar()}{self.waiting()} ({self.cost_source}; "
                f"{self.relaxed})")

    def line(self) -> str:
        """The decision in at most LINE_MAX characters, for stderr: the plan, where it runs, its prediction (the
        one stdout quotes: generation seconds, preparing apart), its speed-up over the fastest AR weighed, what
        narrowed the modes weighed (a hardware profile) and at most one next action; summary() and --json's "plan"
        give the whole account."""
        where = f"{self.backend} ({self.mode})" if self.mode else self.backend
        prepare = f" + {self.prepare_s:.1f} s preparing" if self.prepare_s >= 0.05 else ""
        speedup = (f"{self.speedup_over_fastest_ar:.2f}x the fastest AR" if self.baseline is not None
                   else f"{self.predicted_speedup:.2f}x AR")
        head = (f"auto chose {self.plan.name} on {where}, {self.width} image(s) per step: predicted "
                f"{self.predicted_s:.2f} s{prepare}, {speedup}")
        n = sum(r.get("skipped") == WAITING for r in self.candidates)
        action = f"; {n} plan(s) not measured here yet: `lantern profile calibrate`" if n else ""
        for scope in self.narrowed():
            if len(head + scope + action) <= LINE_MAX:
                return head + scope + action
        return head + action if len(head + action) <= LINE_MAX else head[:LINE_MAX]

    def narrowed(self) -> list[str]:
        """What the line says of a hardware profile's narrowing auto to its backend, longest first ('' last)."""
        if not self.scope.startswith(PROFILE_SCOPE):
            return [""]
        return [f"; {self.scope} narrowed auto to {self.backend}", f"; --profile narrowed auto to {self.backend}",
                ""]

    def waiting(self) -> str:
        """How many plans were not weighed because they are not measured here yet, or ''."""
        n = sum(r.get("skipped") == WAITING for r in self.candidates)
        return (f"; {n} plan(s) not measured here yet wait: later requests measure them with their share of "
                f"deciding, `lantern profile calibrate` now" if n else "")

    def why_ar(self) -> str:
        """When AR was kept though a plan was predicted faster: which, and the bar it missed."""
        faster = [r for r in self.candidates if r.get("predicted_speedup", 0.0) > 1.0 and not r.get("lower_bound")]
        if self.plan != AR or not faster:
            return ""
        best = max(faster, key=lambda r: r["predicted_speedup"])
        if best.get("unconfirmed"):
            return (f"; the best plan, {best['plan']}, was predicted at {best['predicted_speedup']:.2f}x from fewer "
                    f"than {calibration.CONFIRMED} timed runs, too few to choose it (a request long enough to pay "
                    f"for a full calibration, or `lantern profile run`, times it in full)")
        return (f"; the best plan, {best['plan']}, was predicted at {best['predicted_speedup']:.2f}x, under the "
                f"{self.min_speedup:.2f}x a plan needs")


def choosable(row: dict) -> bool:
    """Whether a candidate's prediction may choose it: not a lower bound (a plan too slow to be worth timing) and
    not unconfirmed (timed fewer than calibration.CONFIRMED times, which a noisy machine can flatter by 2x)."""
    return not row.get("lower_bound") and not row.get("unconfirmed")


def allowed_relaxation(allow_relaxed: bool, validated: dict, sampling: SamplingConfig,
                       vocab: int) -> tuple[dict, str]:
    """The relaxed methods auto may use at `sampling` (method -> settings) and why (lantern.plan.validated): those
    the bundle validated at this sampling; with --allow-relaxed every relaxed method (at the bundle's settings
    where it has them, else the preset's); else none (lossless only). validated: Bundle.validations."""
    relaxations = allowed_relaxations(validated, sampling, vocab, allow_relaxed)
    ok = {m: r.settings for m, r in relaxations.items() if r.settings is not None}
    why = "; ".join(f"{m}: {r.why}" for m, r in relaxations.items())
    if allow_relaxed:
        return ok, f"relaxed plans allowed (--allow-relaxed): {why}"
    if ok:
        return ok, f"lossless, plus {', '.join(ok)} where validated at this sampling: {why}"
    return {}, f"lossless plans only: {why}"


def runnable(pipe, plans: list[Plan], sampling: SamplingConfig, width: int) -> tuple[list[Plan], list[dict]]:
    """The plans this pipeline can run at `width` images per step (a window or tree as deep as the image cannot,
    nor a plan whose predicted peak exceeds the memory available: Pipeline.check_fits), and why the others not."""
    ok, skipped = [], []
    for p in plans:
        try:
            pipe.check(p.decode(sampling))
            pipe.check_fits(p.decode(sampling), width, what=f"plan {p.name}")
        except ValueError as e:
            skipped.append({"plan": p.name, "skipped": str(e)})
        else:
            ok.append(p)
    return ok, skipped


def check_min_speedup(value) -> None:
    """Refuse a bad min_speedup, naming the value and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 1.0):
        raise ValueError(f"min_speedup {value!r} is not allowed; allowed: a finite number >= 1 (1: any plan "
                         f"predicted faster than AR; default {MIN_SPEEDUP})")


def choose(pipe: PlanHost, n_images: int, sampling: SamplingConfig, batch: Optional[int] = None,
           allow_relaxed: bool = False,
           profile: Optional[calibration.ProfileCosts] = None, progress: bool = True,
           classes: Optional[Sequence[int]] = None, min_speedup: float = MIN_SPEEDUP,
           prompts: Optional[torch.Tensor] = None, measure_all: bool = False) -> Choice:
    """The plan for `n_images` on this pipeline, with its bundle's validated relaxations and acceptance records
    (`pipe.defaults`). profile: a hardware profile's calibration (else this machine's cached one, measured where
    missing); classes: the request's class ids in order (c2i), to predict each image from its class's steps
    (None: every image from all the record's); min_speedup: the predicted speed-up over AR a plan needs to be
    chosen; prompts: the request's prompt rows (n, P) for a prompt-conditioned target (a model family's), which
    its acceptance record and calibration are measured on where missing. What is missing is measured as far as
    the request's share of deciding covers (lantern.plan.deciding), or all of it with measure_all (`lantern
    profile calibrate`); plans still unmeasured wait, listed among the candidates (WAITING)."""
    check_min_speedup(min_speedup)
    if isinstance(n_images, bool) or not isinstance(n_images, numbers.Integral) or n_images < 1:
        raise ValueError(f"n_images {n_images!r} is not allowed; allowed: an integer >= 1 (the images to plan for)")
    n_images = int(n_images)
    calibration.budget_s()  # a bad $LANTERN_CALIBRATION_BUDGET or $LANTERN_DECIDING_SHARE, and
    deciding.share()
    usable_root()  # a cache folder that cannot be used, are refused before anything is measured
    if classes is not None and len(classes) != n_images:
        raise ValueError(f"{len(classes)} class ids given for {n_images} images")
    width = min(pipe.check(AR.decode(sampling), batch), n_images)
    # before anything is built or timed: AR, the plan that holds the least, must fit, and the others are weighed
    # only where they fit (lantern.decoding.memory)
    pipe.check_fits(AR.decode(sampling), width, what=f"--method auto at {width} image(s) per step (AR, its "
                                                     f"smallest plan)")
    allowed, why = allowed_relaxation(allow_relaxed, pipe.defaults.relaxation or {}, sampling, pipe.config.vocab_size)
    plans, skipped = runnable(pipe, candidate_plans(pipe.drafter is not None, pipe.proximity is not None, allowed),
                              sampling, width)
    key = pipe.model_key
    if profile is not None and any(e.get("model") != key for e in profile.widths.values()):
        print(f"lantern: hardware profile {profile.name} was calibrated with another model; auto uses this "
              f"machine's calibration", file=sys.stderr)
        profile = None
    wanted = list(classes) if classes is not None else [None] * n_images
    # what deciding may spend (lantern.plan.deciding): a share of the request's predicted AR seconds
    if profile is not None:
        ar_costs, spent = calibration.at_width(profile.widths, width), 0.0
        if AR.name not in ar_costs["plans"]:
            raise ValueError(f"hardware profile {profile.name} has no calibration of AR; rerun `lantern profile run`")
    else:
        ar_costs, spent = calibration.ar_estimate(pipe, sampling, width, prompts)
    ar_steps = steps_by_plan(pipe, [AR], sampling, key, False, wanted, prompts)[0][AR.name]
    block = pipe.config.block_size
    per_chunk_s = ar_costs["fixed_s"] + (block - 1) * ar_costs["plans"][AR.name]["step_s"]
    credit = deciding.Credit(calibration.pipe_key(pipe, sampling),
                             predict_seconds(width, ar_costs["fixed_s"], ar_costs["plans"][AR.name]["step_s"],
                                             ar_steps), unlimited=measure_all)
    credit.spend(spent)
    steps, recording = steps_by_plan(pipe, plans, sampling, key, progress, wanted, prompts, credit,
                                     record_s=per_chunk_s * max(1.0, RECORD_IMAGES / width))
    spent += recording
    waiting = [p for p in plans if p.name not in steps]
    if profile is not None:
        costs = ar_costs
        source = f"hardware profile {profile.name}" + (f" (interpolated between batch widths "
                                                       f"{costs['interpolated_from']})" if "interpolated_from" in costs
                                                       else "")
        missing = [p.name for p in plans if p.name not in costs["plans"] and p not in waiting]
        skipped += [{"plan": name, "skipped": f"not calibrated in profile {profile.name}"} for name in missing]
        plans = [p for p in plans if p.name not in missing]
    else:
        costs, source, calibrating, prepared = machine_costs(pipe, [p for p in plans if p not in waiting],
                                                             sampling, key, width, steps, progress, prompts, credit,
                                                             ar_costs)
        spent += calibrating
    credit.bank()
    waiting += [p for p in plans if p not in waiting and p.name not in costs["plans"]]
    skipped += [{"plan": p.name, "skipped": WAITING} for p in waiting]
    plans = [p for p in plans if p not in waiting]
    mean_steps = {p.name: statistics.fmean(statistics.fmean(v) for v in steps[p.name]) for p in plans}

    rows = []
    for p in plans:
        cost = costs["plans"][p.name]
        t = predict_seconds(width, costs["fixed_s"], cost["step_s"], steps[p.name])
        rows.append({"plan": p.name, "lossless": p.lossless, "predicted_seconds": t,
                     "steps_per_image": mean_steps[p.name], "step_ms": 1e3 * cost["step_s"],
                     **{flag: True for flag in ("lower_bound", "unconfirmed", "estimate") if cost.get(flag)}})
    ar_s = rows[0]["predicted_seconds"]  # AR is the first candidate
    for r in rows:
        r["predicted_speedup"] = ar_s / r["predicted_seconds"] if r["predicted_seconds"] else 1.0
    best = min((r for r in rows if choosable(r)), key=lambda r: r["predicted_seconds"])
    if best["predicted_speedup"] < min_speedup or costs.get("disturbed"):  # a disturbed timing: AR, the safe plan
        best = rows[0]
    plan = next(p for p in plans if p.name == best["plan"])
    pipe.release(keep=plan.decode(sampling), batch=width)  # the chosen plan keeps the runner it was timed on
    return Choice(plan=plan, decode=plan.decode(sampling), width=width, deciding=credit.to_dict(),
                  predicted_s=best["predicted_seconds"], predicted_ar_s=ar_s, candidates=rows + skipped,
                  cost_source=source, relaxed=why, min_speedup=min_speedup, calibrated_s=spent,
                  prepared_s=prepared if profile is None else 0.0, disturbed=costs.get("disturbed", ""), pipeline=pipe,
                  scope="pinned" if profile is None else f"{PROFILE_SCOPE}{profile.name}")


def steps_by_plan(pipe, plans: list[Plan], sampling: SamplingConfig, key: str, progress: bool, wanted: list,
                  prompts: Optional[torch.Tensor] = None, credit: Optional[deciding.Credit] = None,
                  record_s: float = 0.0) -> tuple[dict[str, list[list[float]]], float]:
    """Every plan's steps for each requested image (wanted: its class id, or None), from the acceptance record;
    plans it lacks are measured here, once, each while `credit` covers what one is expected to take (record_s,
    then the longest one measured; None: all of them). Returns the steps of the plans that have them (the
    others wait for a later request) and the seconds spent measuring."""
    block = pipe.config.block_size
    credit = credit or deciding.Credit(None, unlimited=True)
    record = records.load_record(key, sampling, pipe.dtype, pipe.defaults.acceptance_records)
    missing = [p for p in plans if records.plan_steps(record, p, block) is None]
    t0 = time.perf_counter()
    if missing and credit.covers(record_s):
        with records.locked(key, sampling, pipe.dtype):  # read again: another process may have measured them
            record = records.load_record(key, sampling, pipe.dtype, pipe.defaults.acceptance_records)
            missing = [p for p in plans if records.plan_steps(record, p, block) is None]
            if missing:
                _measure_record(pipe, missing, record, sampling, key, progress, prompts, credit, record_s)
    spent = time.perf_counter() - t0 if missing else 0.0
    per_image = {p.name: records.per_image_steps(records.plan_steps(record, p, block),
                                                 records.plan_conditions(record, p), wanted)
                 for p in plans if records.plan_steps(record, p, block) is not None}
    return per_image, spent


def _measure_record(pipe, missing: list[Plan], record: dict, sampling: SamplingConfig, key: str, progress: bool,
                    prompts: Optional[torch.Tensor], credit: deciding.Credit, record_s: float) -> None:
    """The missing plans' acceptance, in their order, each while the credit covers the longest one so far."""
    print(f"lantern: measuring the acceptance of {len(missing)} plan(s) for this model, sampling and dtype, once "
          f"({RECORD_IMAGES} images each; cached in {records.record_path(key, sampling, pipe.dtype)})"
          + ("" if credit.covers(record_s * len(missing)) else
             f"; as many as this request's share of deciding covers (about {record_s:.1f} s each, "
             f"{max(credit.left, 0.0):.1f} s left): the rest in later requests, or now by `lantern profile "
             f"calibrate`"), file=sys.stderr)
    cond = calibration.conditions(pipe.config, RECORD_IMAGES, prompts)
    for plan in missing:
        if not credit.covers(record_s):
            break
        t0 = time.perf_counter()
        records.measure_record(lambda p: run_batch(pipe, p.decode(sampling), RECORD_IMAGES, cond),
                               [plan], record, cond if isinstance(cond, list) else None, progress)
        took = time.perf_counter() - t0
        credit.spend(took)
        record_s = max(record_s, took)
        records.save_record(record)  # each as it is measured: a stopped request keeps what it paid for
    pipe.release()


def probe_cost_s(costs: dict, n_plans: int) -> float:
    """What a first-run probe of n_plans is expected to take (preparing runners apart), at most its budget: per
    plan a warm-up, an AR reference and a run of its own of FIRST_STEPS steps, then the leader and a plan close to
    it confirmed in pairs of TIMED_STEPS-step runs, and a closing reference; costs: an entry holding AR's."""
    fixed, step = costs["fixed_s"], costs["plans"][AR.name]["step_s"]

    def run(steps: int) -> float:
        return fixed + steps * step * PLAN_STEP
    confirming = 2 * (PROBE_ROUNDS["max_rounds"] - PROBE_ROUNDS["rounds"])
    total = (n_plans * (run(2) + 2 * run(calibration.FIRST_STEPS)) + confirming * 2 * run(calibration.TIMED_STEPS)
             + run(calibration.TIMED_STEPS))
    return min(total, probe_rounds()["budget"])


def machine_costs(pipe, plans: list[Plan], sampling: SamplingConfig, key: str, width: int,
                  steps: dict[str, list[list[float]]], progress: bool, prompts: Optional[torch.Tensor] = None,
                  credit: Optional[deciding.Credit] = None,
                  ar_costs: Optional[dict] = None) -> tuple[dict, str, float, float]:
    """This machine's calibration at `width`, where it is kept, and the seconds spent timing and preparing runners
    for it (0, 0 when cached). steps: each requested image's steps per plan (a plan is timed over the steps and at
    the attention width of the request's first chunk). A measurement runs only when the request's `credit`
    (lantern.plan.deciding; None: unlimited) covers it: a width never calibrated (or plans new to a first-run
    entry) gets the first-run probe (PROBE_ROUNDS, probe_cost_s), kept `provisional` and refined in full rounds
    once the credit covers calibration.budget_s(); until then the request weighs what is cached (AR alone, from
    `ar_costs`, when nothing is) and the plans not timed wait. Measured under the calibration's lock, not stored
    when disturbed (calibration.cached_or_measured)."""
    credit = credit or deciding.Credit(None, unlimited=True)
    key_c = calibration.pipe_key(pipe, sampling)
    path = calibration.calibration_path(key_c)
    cached = calibration.load_calibration(key_c)["widths"].get(str(width))
    untimed = [p for p in plans if not cached or p.name not in cached["plans"]]
    known = cached or ar_costs  # AR's costs at least, to expect what a probe takes
    probe_s = probe_cost_s(known, len(untimed)) if untimed and known else 0.0
    if untimed and known and not credit.covers(probe_s):
        kind = "first-run probe " if cached and cached.get("provisional") else ""
        source = (f"{kind}calibration cached in {path}" if cached else "AR's quick estimate, not calibrated yet")
        return known, (f"{source}; {len(untimed)} plan(s) wait to be timed until requests have banked the "
                       f"{probe_s:.1f} s it takes (`lantern profile calibrate` times them now)"), 0.0, 0.0
    before: list[float] = []  # (seconds, prepare_s) of the entry before measuring; empty when nothing was

    def refines(entry: dict) -> bool:  # a provisional entry the credit pays timing in full
        return bool(entry.get("provisional")) and credit.covers(calibration.budget_s())

    def measure(entry: Optional[dict]) -> dict:
        lacking = [p for p in plans if not entry or p.name not in entry["plans"]]
        probe = entry is None or (bool(entry.get("provisional")) and bool(lacking))
        if not lacking:  # stale: a provisional entry refined, every plan timed again in full rounds
            lacking, entry = plans, None
        print(f"lantern: calibrating {len(lacking)} plan(s) on {pipe.backend.name} ({pipe.dtype}) at {width} "
              f"image(s) per step, {'a first-run probe' if probe else 'in full'} (cached in {path}; "
              f"`lantern profile run` refreshes it)", file=sys.stderr)
        before.extend(((entry or {}).get("seconds", 0.0), (entry or {}).get("prepare_s", 0.0)))
        first = {p.name: steps[p.name][:width] for p in lacking}  # the first chunk's images
        per_chunk, attended = records.chunk_timing(first)
        entry = calibration.measure_width(pipe, lacking, sampling, width, per_chunk, entry, progress, attended,
                                          prompts=prompts, **(probe_rounds() if probe else {}))
        if probe:
            entry["provisional"] = True
        else:
            entry.pop("provisional", None)
        return entry
    spent = [0.0, 0.0]  # seconds timing and preparing runners, over the measurements below

    def measured() -> tuple[dict, str, str]:
        before.clear()
        tries = calibration.AHEAD_TRIES if credit.unlimited else 1
        entry, where, disturbed = calibration.cached_or_measured(key_c, width, [p.name for p in plans], measure,
                                                                 stale=refines, tries=tries)
        if before:
            timing, preparing = entry["seconds"] - before[0], entry["prepare_s"] - before[1]
            spent[0] += timing
            spent[1] += preparing
            credit.spend(timing + preparing)
        return entry, where, disturbed
    entry, where, disturbed = measured()
    if before and not disturbed and refines(entry):  # this request probed, and its credit pays for full rounds
        entry, where, disturbed = measured()
    kind = "first-run probe " if entry.get("provisional") else ""
    source = (f"{kind}calibration disturbed ({disturbed}), not cached" if disturbed
              else f"{kind}calibration cached in {where}")
    if disturbed:
        entry = {**entry, "disturbed": disturbed}
    return entry, source, spent[0], spent[1]
