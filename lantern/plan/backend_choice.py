"""`--method auto` for the command line, the service and Pipeline (plan_request). With no backend pinned, auto
weighs every mode this machine runs (eager, compiled, fused, onnx; docs/auto.md#backend-and-mode) by one cost model,
each plan's one-time cost counted against the request:

    T(backend, plan) = prepare(backend, plan) + the plan's predicted generation seconds there (choose.py)

prepare is 0 when this process holds the prepared runner; for a plan prepared here before, what preparing it again
took here (its compile on disk: a re-trace; the ledger's `again`), else its first preparation x WARM_SHARE; else
PRIOR_PREPARE_S of its mode. A speculative plan must be
predicted min_speedup times faster than the fastest AR over the modes. Another mode is calibrated (AR and the
CROSS_PLANS plans the default backend ranks best) only when preparing its runners is expected to cost no more than
the request, or ahead of time (`calibrate_all`). A candidate is a backend name, or a graph backend's name + FUSED
(fused_step=True), whose calibration and ledger are its own (calibration.costs_name).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
from typing import Callable, Optional, Sequence

from lantern.backends.registry import ENV_VAR, backend_class, registered, resolve_name
from lantern.decoding.sampling import SamplingConfig
from lantern.plan import calibration, deciding, acceptance_records as records
from lantern.plan.calibration import FUSED  # a candidate name's suffix: the backend with fused_step=True
from lantern.plan.candidates import AR, Plan, candidate_plans
from lantern.plan.cost_model import predict_seconds
from lantern.plan.host import PlanHost
from lantern.plan.choose import (MIN_SPEEDUP, Choice, allowed_relaxation, choosable, choose, probe_rounds,
                                 steps_by_plan)
from lantern.files.user_cache import (CacheUnusable, cache_root, entry_folder, entry_lock, field_problem, is_number,
                                      read_entry, write_entry)

# A mode is named by what preparing its runners costs, as its backend declares it (Abilities.preparation); a backend
# declaring a fused step is weighed with it too, as the mode "fused" (CUDA's: AR 4.7x the per-module CUDA graphs'
# speed on an H100, results/gpu-nvidia-h100-80gb-hbm3.md).
MODE_OF_PREPARATION: dict[str, str] = {"none": "eager", "compile": "compiled", "export": "onnx", "capture": "graphs"}
# Seconds to prepare one runner in a mode never prepared on this machine: a prior used only until the first
# preparation is measured (inductor compiles of the embedded model's steps take tens of seconds on a CPU; its
# fused steps 40-130 s cold, as tools/bench_fused_step.py reports them).
PRIOR_PREPARE_S: dict[str, float] = {"eager": 1.0, "compiled": 30.0, "fused": 60.0, "onnx": 20.0, "graphs": 30.0}
# A new process preparing a plan again re-traces its compile against the caches on disk: 6.6-7.2 s after a 46-49 s
# cold compile on a 2-core AMD EPYC (results/second-request*-cpu.md); a prior until a repeat is measured here.
WARM_SHARE = 0.2
CROSS_PLANS = 2  # plans besides AR calibrated on another mode: the default backend's best


def mode_of(candidate: str) -> str:
    """eager, compiled, onnx, graphs (its backend's declared preparation), or fused (with fused_step=True)."""
    backend, options = backend_of(candidate)
    return "fused" if options.get("fused_step") else MODE_OF_PREPARATION[backend_class(backend).abilities.preparation]


def backend_of(candidate: str) -> tuple[str, dict]:
    """(backend name, backend constructor options) of a candidate mode."""
    if candidate.endswith(FUSED):
        return candidate[:-len(FUSED)], {"fused_step": True}
    return candidate, {}


def mode_row(candidate: str, **fields) -> dict:
    """A `backends` row of the plan: the backend, the mode, whether the step is fused, then `fields`."""
    backend, options = backend_of(candidate)
    return {"backend": backend, "mode": mode_of(candidate), "fused_step": bool(options.get("fused_step")), **fields}


def pinned_backend(name: Optional[str]) -> Optional[str]:
    """The backend the user pinned (the argument, else $LANTERN_BACKEND), or None when both say auto or nothing."""
    raw = (name or os.environ.get(ENV_VAR) or "auto").strip().lower()
    return None if raw == "auto" else raw


def modes_with(default: str) -> list[str]:
    """The modes auto weighs beside the default backend (first): every registered backend whose runners use the
    default's kind of device, each also with its fused step where it declares one (as it declares them: no list of
    names)."""
    kind = backend_class(default).abilities.device_kind
    out = []
    for name in [default, *(n for n in registered() if n != default)]:
        abilities = backend_class(name).abilities
        if abilities.device_kind == kind:
            out += [name, name + FUSED] if abilities.fused_step else [name]
    return out


def candidate_backends(dtype: Optional[str] = None) -> tuple[list[str], list[dict], str]:
    """The modes auto weighs here (the default backend first) for `dtype` (None: the default backend's
    preferred one), the others of the family with why they are left out, and the dtype: as the backend classes
    declare them (Abilities.dtypes), none built."""
    default = resolve_name("auto")
    dtype = dtype or backend_class(default).abilities.dtypes[0]
    names, left_out = [], []
    for name in modes_with(default):
        backend = backend_of(name)[0]
        avail = backend_class(backend).availability()
        if not avail.ok:
            left_out.append(mode_row(name, status=f"unavailable: {avail.reason}"))
        elif dtype not in backend_class(backend).abilities.dtypes:
            left_out.append(mode_row(name, status=f"unavailable: no {dtype}"))
        else:
            names.append(name)
    return names, left_out, dtype


# --- the prepare ledger: what preparing each plan's runner cost on this machine, and how fast its runs went ------
RUNS_KEPT = 5  # preparations repeated ("again") and step seconds of generations ("ran") kept per plan
RAN = "prepared and run here before, timed in its generations"


def ledger_path(key: dict):
    return cache_root() / "prepare" / calibration.calibration_path(key).name


def ledger_problem(data: dict) -> str:
    """'' if `data` has a prepare ledger's shape, else what is wrong (the ledger is then started again). Per width
    and plan: the last preparation's seconds (widths) and when it started, the seconds of the preparations that
    repeated an earlier one (again) and the step seconds of generations (ran)."""
    wrong = field_problem(data, "key", dict) or field_problem(data, "widths", dict)
    for field, listed in (("widths", False), ("started", False), ("again", True), ("ran", True)):
        wrong = wrong or field_problem({field: {}, **data}, field, dict)
        for width, entry in data.get(field, {}).items() if not wrong else ():
            for name, value in entry.items() if isinstance(entry, dict) else [("", None)]:
                values = value if listed else [value]
                if not isinstance(values, list) or not all(is_number(s) and s >= 0 for s in values):
                    return f"{field}[{width!r}][{name!r}] must be {'a list of ' * listed}seconds >= 0"
    return wrong


def load_ledger(key: dict) -> dict:
    data = read_entry(ledger_path(key), ledger_problem)
    return data if data and data.get("key") == key else {"key": key, "widths": {}}


def record_prepared(pipe, key: dict, width: int, plans: Sequence[Plan], sampling: SamplingConfig,
                    step_s: Optional[float] = None, again: bool = False) -> dict:
    """Store the prepare seconds of every plan's runner this pipeline prepared (at `width`), and `step_s`, the
    seconds per step a generation of plans[0] took; returns the ledger. A preparation of a plan prepared here
    before (by another preparation: each is known by when it started), or `again` (prepared a second time on
    purpose), is kept among the repeated ones, which are what preparing it costs from then on."""
    seen = {pipe.spec(p.decode(sampling), width): p.name for p in plans}
    fresh = {seen[spec]: (pipe.prepare_started[spec], s) for spec, s in pipe.prepare_seconds.items() if spec in seen}
    if not fresh and step_s is None:
        return load_ledger(key)
    path = ledger_path(key)
    entry_folder(path.parent.name)
    with entry_lock(path, "the prepare ledger"):  # read, update and write as one: another process may add to it
        ledger = load_ledger(key)
        last, started, repeated = (ledger.setdefault(f, {}).setdefault(str(width), {})
                                   for f in ("widths", "started", "again"))
        for name, (t, seconds) in fresh.items():
            if again or (name in last and started.get(name) != t):
                repeated[name] = [*repeated.get(name, []), seconds][-RUNS_KEPT:]
            elif repeated.get(name):  # the latest repeated preparation, grown since (a fused step's compile)
                repeated[name][-1] = seconds
            last[name], started[name] = seconds, t
        if step_s is not None:
            runs = ledger.setdefault("ran", {}).setdefault(str(width), {})
            runs[plans[0].name] = [*runs.get(plans[0].name, []), step_s][-RUNS_KEPT:]
        write_entry(path, ledger)
    return ledger


def record_run(pipe: PlanHost, decode, run) -> None:
    """After a generation of `decode` on `pipe` (run: its lantern.engine.BatchRun), a named method's or auto's:
    where it is one of auto's plans, the ledger keeps what preparing its runner took and its median step (compiles
    at a runner's first steps fall outside it), for a later auto to weigh it here as prepared. An unusable cache
    records nothing (auto refuses it itself, naming it)."""
    allowed = allowed_relaxation(True, pipe.defaults.relaxation or {}, decode.sampling, pipe.config.vocab_size)[0]
    plan = next((p for p in candidate_plans(pipe.drafter is not None, pipe.proximity is not None, allowed)
                 if p.decode(decode.sampling) == decode), None)
    with contextlib.suppress(CacheUnusable):
        if plan is not None and run.step_seconds:
            record_prepared(pipe, calibration.pipe_key(pipe, decode.sampling), run.stats.batch, [plan],
                            decode.sampling, statistics.median(run.step_seconds))


def prepare_cost(pipe: Optional[PlanHost], ledger: dict, plan: Plan, sampling: SamplingConfig, width: int,
                 mode: str) -> tuple[float, str]:
    """(seconds, source) of the one-time cost `plan` adds to a request on this pipeline (of `mode`; None: a
    pipeline not built yet, which holds nothing prepared). A plan prepared here before is prepared again against
    its compile (or export) kept on disk: at what that cost here, else at WARM_SHARE of its first preparation."""
    if pipe is not None and pipe.prepared(plan.decode(sampling), width):
        return 0.0, "prepared in this process"
    repeated = ledger.get("again", {}).get(str(width), {}).get(plan.name)
    if repeated:
        return (statistics.median(repeated),
                "prepared here before: the median of its preparations again here (its compile on disk)")
    last = ledger["widths"].get(str(width), {}).get(plan.name)
    if last is not None:
        return WARM_SHARE * float(last), f"prepared here before: {WARM_SHARE:g} x its first preparation here"
    return PRIOR_PREPARE_S.get(mode, PRIOR_PREPARE_S["compiled"]), "prior: never prepared here"


def plan_request(pipe: PlanHost, n_images: int, sampling: SamplingConfig, make_pipe: Callable[..., PlanHost],
                 batch: Optional[int] = None, allow_relaxed: bool = False,
                 profile: Optional[calibration.ProfileCosts] = None, progress: bool = True,
                 classes: Optional[Sequence[int]] = None, min_speedup: Optional[float] = None, prompts=None) -> Choice:
    """What `--method auto` means for the command line, the service and Pipeline alike: the plan for n_images on
    `pipe` (a Pipeline), its one-time costs weighed over them (a request's images; a service's SERVICE_HORIZON of
    lantern.plan.choose), on its backend alone (choose) where pinned (`pipe.pinned`), given a hardware profile's
    calibration or a model family's target (prompt rows, no relaxation validated); else over every mode
    (choose_backend), pipe the default mode's pipeline and make_pipe(backend, dtype, **options) the others'."""
    common = dict(batch=batch, allow_relaxed=allow_relaxed, progress=progress, classes=classes,
                  min_speedup=MIN_SPEEDUP if min_speedup is None else min_speedup)
    family = pipe.config.family if pipe.config.model_type == "prompt" else None
    if family is None and profile is None and not pipe.pinned:
        return choose_backend(make_pipe, n_images, sampling, dtype=pipe.dtype, default=pipe, **common)
    choice = choose(pipe, n_images, sampling, profile=profile, prompts=prompts, **common)
    choice.mode = mode_of(calibration.costs_name(pipe))
    if family is not None:
        choice.scope = f"a {family} folder: the backend given, lossless plans only"
        choice.relaxed = f"lossless plans only (no relaxation is validated for {family} models)"
    return choice


def _weighable(choice: Choice) -> list[dict]:
    """The candidates a choice may run: every timed plan, or AR alone when its calibration was disturbed."""
    return [r for r in choice.candidates if "predicted_seconds" in r and choosable(r)
            and (not choice.disturbed or r["plan"] == AR.name)]


def anchored(entry: dict, anchor_ar_step_s: float) -> dict:
    """A mode's calibration entry on the default mode's time scale. Each mode is timed at another moment, and a
    shared machine's speed drifts by tens of percent between moments (an Intel Xeon VM's calibrations once put
    the fused AR 1.7x above the compiled AR that it beat by 13% in the same run); within an entry every cost is a
    ratio to its own AR, and the entry's AR was timed paired with the default mode's AR (`ar_to_anchor`), so
    cost x (its AR's paired ratio to the anchor x the anchor's AR step) / its own AR step compares across modes.
    An entry without anchor runs (the default mode's own) is returned as it is."""
    ratios = entry.get("ar_to_anchor")
    if not ratios or AR.name not in entry["plans"]:
        return entry
    scale = statistics.median(ratios) * anchor_ar_step_s / max(entry["plans"][AR.name]["step_s"], 1e-12)
    plans = {name: {**v, "step_s": v["step_s"] * scale} for name, v in entry["plans"].items()}
    return {**entry, "fixed_s": entry["fixed_s"] * scale, "plans": plans, "anchor_scale": scale}


def _other_mode(pipe_of: Callable[[], PlanHost], mode: str, key: dict, cross: list[Plan],
                sampling: SamplingConfig, width: int, request_s: float, calibrate_all: bool, progress: bool,
                steps_of: Callable[[list[Plan]], dict],
                anchor: Callable[[int], float]) -> tuple[Optional[dict], str, float]:
    """Another mode's (`mode`) calibration at `width` for the plans `cross`: (entry or None, why not, seconds spent).
    What it lacks is measured (under the calibration's lock; not kept when disturbed) when preparing its runners is
    expected to cost no more than the request (`request_s`), or `calibrate_all`: in full rounds when the request
    pays for them (its predicted time at least calibration.budget_s(), as the default mode's), refining a probe's
    entry; else as a first-run probe (`provisional`). Its AR references are paired with `anchor`
    (calibration.ar_step_timer of the default mode). pipe_of() -> its pipeline, built only when it is measured."""
    entry = calibration.load_calibration(key)["widths"].get(str(width))
    full = calibrate_all or request_s >= calibration.budget_s()

    def refines(cached: dict) -> bool:  # a probe's entry this request pays for timing in full
        return full and bool(cached.get("provisional"))
    lacking = [p for p in cross if not entry or p.name not in entry["plans"]]
    if not lacking and not refines(entry or {}):
        return entry, "", 0.0
    cost = sum(prepare_cost(None, load_ledger(key), p, sampling, width, mode)[0] for p in lacking)
    if not calibrate_all and cost > request_s:
        if entry and AR.name in entry["plans"]:
            return entry, "", 0.0  # weighed on what it has
        return None, (f"not calibrated: preparing it, about {cost:.0f} s, would cost more than this request's "
                      f"predicted {request_s:.1f} s; `lantern profile calibrate` calibrates it ahead"), 0.0
    pipe = pipe_of()
    before: list[float] = []  # seconds timing and preparing in the entry before measuring; empty: nothing was

    def measure(entry: Optional[dict]) -> dict:
        todo = [p for p in cross if not entry or p.name not in entry["plans"]]  # what it lacks once locked
        before.append(entry["seconds"] + entry.get("prepare_s", 0.0) if entry else 0.0)
        if not todo:  # a probe's entry refined: every plan timed again in full rounds
            todo, entry = cross, None
        steps = steps_of(todo)
        first = {p.name: steps[p.name][:width] for p in todo}  # the first chunk's images
        per_chunk, attended = records.chunk_timing(first)
        entry = calibration.measure_width(pipe, todo, sampling, width, per_chunk, entry, progress, attended,
                                          anchor=anchor, **({} if full else probe_rounds()))
        if not full:  # (a full measurement over a probe's entry keeps its flag: its other plans were probed)
            entry["provisional"] = True
        return entry
    entry, _, disturbed = calibration.cached_or_measured(key, width, [p.name for p in cross], measure,
                                                         stale=refines,
                                                         tries=calibration.AHEAD_TRIES if calibrate_all else 1)
    if not before:  # another process calibrated it while this one waited
        return entry, "", 0.0
    spent = entry["seconds"] + entry["prepare_s"] - before[0]
    if disturbed:
        pipe.release()
        return None, f"calibration disturbed ({disturbed}), not cached", spent
    if calibrate_all:  # ahead of time: prepare again, as a new process would with the compile / export caches warm
        pipe.release()
        pipe.backend.forget_prepared()  # else this process's own compiled graphs make the preparation read as free
        for plan in lacking:
            if not entry["plans"][plan.name].get("lower_bound"):
                calibration.compile_fused_step(pipe, plan.decode(sampling), width)  # the runner (+ fused step)
    record_prepared(pipe, key, width, lacking, sampling, again=calibrate_all)
    return entry, "", spent


def _ran(weighed: dict, ledgers: dict, by_name: dict, base_pipe, sampling: SamplingConfig, width: int,
         wanted: list) -> dict:
    """weighed ((mode, plan) -> its prediction row) with the plans each mode ran in generations here (the
    ledger's "ran"): by their calibration where it timed them, else (or where AR's quick estimate alone knows
    them) by the median of their runs' seconds per step; a plan with no acceptance record here is left out."""
    out = dict(weighed)
    for name, ledger in ledgers.items():
        runs = {p: r for p, r in ledger.get("ran", {}).get(str(width), {}).items() if p in by_name}
        steps = steps_by_plan(base_pipe, [by_name[p] for p in runs], sampling, base_pipe.model_key, False, wanted,
                              credit=deciding.Credit(None), record_s=float("inf"))[0] if runs else {}
        for plan in steps:
            if out.get((name, plan), {"estimate": True}).get("estimate"):
                out[name, plan] = {"plan": plan, "timed_runs": len(runs[plan]), "predicted_seconds": predict_seconds(
                    width, 0.0, statistics.median(runs[plan]), steps[plan])}
    return out


def choose_backend(make_pipe: Callable[..., object], n_images: int, sampling: SamplingConfig,
                   batch: Optional[int] = None, allow_relaxed: bool = False, progress: bool = True,
                   classes: Optional[Sequence[int]] = None, min_speedup: Optional[float] = None,
                   dtype: Optional[str] = None, calibrate_all: bool = False, default=None) -> Choice:
    """The backend, mode and plan for the request. make_pipe(backend name, dtype, **backend options) -> a Pipeline
    of the same models and defaults there (`dtype` None: the default backend's preferred; options: {"fused_step":
    True} for the fused mode), the default mode's `default` where given; calibrate_all: calibrate every mode
    whatever the request (ahead of time) instead of only those the request can pay for."""
    min_speedup = MIN_SPEEDUP if min_speedup is None else min_speedup
    names, left_out, dtype = candidate_backends(dtype)
    if not names:
        raise ValueError(f"no backend of this machine runs {dtype}: " + "; ".join(r["status"] for r in left_out))
    pipes = {names[0]: make_pipe(names[0], dtype) if default is None else default}  # the default backend: eager
    base_pipe = pipes[names[0]]
    common = dict(allow_relaxed=allow_relaxed, classes=classes, min_speedup=min_speedup)
    choices = {names[0]: choose(base_pipe, n_images, sampling, batch=batch, progress=progress,
                                measure_all=calibrate_all, **common)}
    base, key = choices[names[0]], base_pipe.model_key
    width = base.width
    allowed, _ = allowed_relaxation(allow_relaxed, base_pipe.defaults.relaxation or {}, sampling,
                                    base_pipe.config.vocab_size)
    by_name = {p.name: p for p in candidate_plans(base_pipe.drafter is not None, base_pipe.proximity is not None,
                                                  allowed)}
    ledgers = {names[0]: record_prepared(base_pipe, calibration.pipe_key(base_pipe, sampling),
                                         width, list(by_name.values()), sampling)}
    request_s = min(r["predicted_seconds"] for r in _weighable(base))
    wanted = list(classes) if classes is not None else [None] * n_images
    ranked = sorted((r for r in base.candidates if "predicted_seconds" in r and not r.get("lower_bound")
                     and r["plan"] != AR.name), key=lambda r: r["predicted_seconds"])  # unconfirmed ones too
    cross = [AR, *(by_name[r["plan"]] for r in ranked[:CROSS_PLANS])]
    anchor = calibration.ar_step_timer(base_pipe, sampling, width)
    anchor_ar_step_s = next(r["step_ms"] for r in base.candidates if r["plan"] == AR.name) / 1e3
    rows, unweighed, spent = list(left_out), {}, base.calibrated_s

    def pipe_of(name: str) -> PlanHost:  # another mode's pipeline, built once it is measured, weighed or run
        if name not in pipes:
            pipes[name] = make_pipe(backend_of(name)[0], dtype, **backend_of(name)[1])
        return pipes[name]
    for name in names[1:]:
        backend, backend_options = backend_of(name)
        not_fusable = backend_options.get("fused_step") and backend_class(backend).fused_step_problem(base_pipe.target)
        if not_fusable:  # its runners would keep per-module graphs: the compiled mode, weighed already
            rows.append(mode_row(name, status=f"unavailable: {not_fusable}"))
            continue
        # the fused mode's calibration is its own; a candidate's name is its costs' (calibration.costs_name)
        key_c = calibration.calibration_key(name, dtype, key, sampling, base_pipe.config.vocab_size)
        entry, status, seconds = _other_mode(lambda n=name: pipe_of(n), mode_of(name), key_c, cross,
                                             sampling, width, request_s, calibrate_all, progress,
                                             lambda plans, n=name: steps_by_plan(pipe_of(n), plans, sampling, key,
                                                                                 False, wanted)[0],
                                             anchor)
        spent += seconds
        ledgers[name] = load_ledger(key_c)
        if entry is None:
            unweighed[name] = mode_row(name, status=status)
            continue
        entry = anchored(entry, anchor_ar_step_s)
        profile = calibration.ProfileCosts(f"{name} calibration on this machine",
                                           {str(width): {**entry, "model": key}})
        choices[name] = choose(pipe_of(name), n_images, sampling, batch=batch, progress=False, profile=profile,
                               **common)
        kind = "first-run probe " if entry.get("provisional") else ""
        scale = (f", x{entry['anchor_scale']:.2f} onto {names[0]}'s time scale" if "anchor_scale" in entry
                 else f", not anchored to {names[0]}")
        choices[name].cost_source = f"{kind}calibration cached in {calibration.calibration_path(key_c)}{scale}"

    options = {}  # (candidate mode, plan) -> (total seconds, candidate mode, plan's row, prepare seconds, its source)
    rows_by = _ran({(n, r["plan"]): r for n, ch in choices.items() for r in _weighable(ch)}, ledgers, by_name,
                   base_pipe, sampling, width, wanted)
    for (name, plan), r in rows_by.items():
        prep, source = prepare_cost(pipes.get(name), ledgers[name], by_name[plan], sampling, width, mode_of(name))
        options[name, plan] = (prep + r["predicted_seconds"], name, r, prep, source)
    weighed = dict.fromkeys(o[1] for o in options.values())
    rows += [row for name, row in unweighed.items() if name not in weighed]
    for name in weighed:
        ar = options.get((name, AR.name), (None, name, {}, None))
        best = min((o for o in options.values() if o[1] == name), key=lambda o: o[0])
        rows.append(mode_row(name, status="weighed", cost_source=choices[name].cost_source if name in choices
                             else RAN, ar_seconds=ar[0], ar_prepare_seconds=ar[3], best_plan=best[2]["plan"],
                             best_seconds=best[0], best_prepare_seconds=best[3]))
    options = list(options.values())
    fastest_ar = min((o for o in options if o[2]["plan"] == AR.name), key=lambda o: o[0])
    best = min(options, key=lambda o: o[0])
    if best[2]["plan"] != AR.name and fastest_ar[0] < min_speedup * best[0]:
        best = fastest_ar  # not fast enough against the fastest AR: that AR
    total, name, row, prep, source = best
    plan = by_name[row["plan"]]
    chosen = dataclasses.replace(choices.get(name, base), plan=plan, decode=plan.decode(sampling),
                                 predicted_s=row["predicted_seconds"], pipeline=pipe_of(name), mode=mode_of(name),
                                 scope="every mode",  # (another mode's costs reach choose as a profile's: no narrowing)
                                 baseline=mode_row(fastest_ar[1], predicted_seconds=fastest_ar[0],
                                                   prepare_seconds=fastest_ar[3]),
                                 prepare_s=prep, prepare_source=source, calibrated_s=spent,
                                 backends=sorted(rows, key=lambda r: r["status"].startswith("unavailable")))
    for other, pipe in pipes.items():
        if other != name:
            pipe.release()
    pipes[name].release(keep=chosen.decode, batch=width)
    # prepared here (a fused step compiled too), so the ledger learns what this preparation cost
    calibration.compile_fused_step(pipes[name], chosen.decode, width)
    record_prepared(pipes[name], calibration.pipe_key(pipes[name], sampling), width, [plan], sampling)
    return chosen
