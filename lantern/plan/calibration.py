"""Latency calibration: what one decode step of each plan costs on this machine, backend and dtype, at a batch
width, measured with the real decode loop (drafting, verify, acceptance and commit included). CPU runners attend
only the cache slots in use, so an image's first steps are cheaper than its average: steps are timed attending as
many slots as a plan's steps do on average over a chunk (`Runner.attend_at_least`, records.attended_fraction).
Per width w:

    fixed_s            one chunk's prefill, first draw and statistics (AR with a one-token image)
    plans[name].step_s (wall time of a short generation - fixed_s) / its loop steps, relative to an AR run of
                       as many steps timed just before it (median ratio x AR's median step; AR's own: the
                       median of every AR run); with `lower_bound`, only a floor: the plan could not contend,
                       or its first run did not fit in the budget, so it was never timed; with
                       `unconfirmed`, timed fewer than CONFIRMED times: shown, never chosen
    seconds            the timing; prepare_s: preparing runners and exporting graphs, which later runs reuse

Cached per (machine, backend, dtype, threads, model, sampling cost: `sampling_costs`) in the user cache
(calibration/<key>.json), measured once per missing (plan, width), by one process at a time
(`cached_or_measured`), and not stored when disturbed (`disturbance`: the run that measured it keeps AR).
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Sequence

import torch
from tqdm import tqdm

from lantern.backends.environment import cpu_model
from lantern.decoding.sampling import SamplingConfig
from lantern.engine import run_batch
from lantern.engine.fused import WARM_CALLS
from lantern.models.family import neutral_conditions
from lantern.plan.candidates import AR, Plan
from lantern.plan.cost_model import bracket, dearest_no_wider, interpolate
from lantern.files.user_cache import (cache_root, entry_folder, entry_lock, field_problem, is_number, read_entry,
                                      write_entry)

FIXED_REPEATS = 3
FIRST_STEPS = 6  # loop steps per timed run in round 1 (every plan)
TIMED_STEPS = 12  # loop steps per timed run in the later rounds (the contenders)
ROUNDS = 3  # timed runs of each contending plan at least (1 for the others) ...
MAX_ROUNDS = 16  # ... and more while the next run fits in BUDGET_S
AHEAD_TRIES = 3  # measurements of a disturbed calibration made ahead of time (`lantern profile calibrate`)
BUDGET_S = 30.0  # a width's timing (preparing runners apart) starts no run it expects to end past this
CONTENDER = 1.5  # a plan contends when its estimated seconds per chunk are within this factor of the best
CLOSE = 1.15  # rounds past ROUNDS time only the plans this close to the best: the choice hinges on them
CONFIRMED = 3  # timed runs a plan needs before it may be chosen: one run of a few steps is noise (a first-run
# probe on an Intel Xeon VM timed MC-SJD's step at 1.19x AR's where whole runs take 1.7-1.8x, and AR's own at 1.41x)
WIDER_SLACK = 0.9  # a step with a wider verify costs at least this fraction of a narrower one's (timing noise)
BUDGET_ENV = "LANTERN_CALIBRATION_BUDGET"  # seconds, overrides BUDGET_S (a slow machine may want less)
DISTURBED = 3.0  # runs of the same thing this many times apart: the machine was loaded while timing (a concurrent
# calibration made them 80-100x apart); the pairing with AR absorbs a slow spell, not one that starts within a pair


@dataclass(frozen=True)
class ProfileCosts:
    """A hardware profile's calibration: its name and entries by width (str(width) -> entry, as cached here)."""

    name: str
    widths: dict


# A host that shares the cores with its own work (a service serving while it calibrates in the background) hands
# calibration its turns: turn() -> a context manager entered around each timed block (a plan's run with its AR
# reference, the fixed-cost runs, the closing reference), which waits until the host has no work and holds it off
# meanwhile. The seconds spent waiting are not timing: they count neither against the budget nor in `seconds`.
_TURN: contextvars.ContextVar = contextvars.ContextVar("lantern_calibration_turn", default=None)


@contextlib.contextmanager
def sharing_cores(turn: Callable[[], ContextManager]):
    """Within this block (in this thread), calibration times its runs only in turns taken from `turn()`."""
    token = _TURN.set(turn)
    try:
        yield
    finally:
        _TURN.reset(token)


def _turn() -> ContextManager:
    turn = _TURN.get()
    return turn() if turn is not None else contextlib.nullcontext()


def machine_id() -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": socket.gethostname(), "cpu": cpu_model(), "cores": os.cpu_count(), "gpu": gpu,
            "platform": platform.platform()}


FUSED = "+fused"  # the costs of a graph backend running the engine's whole step as one graph (fused_step=True)


def costs_name(pipe) -> str:
    """The name this pipeline's step costs are kept under: its backend's, + FUSED when the backend runs the
    fused step (lantern.engine.fused), whose costs are not per-module graphs'."""
    return pipe.backend.name + (FUSED if pipe.backend.fused_step else "")


# What a step costs depends on lantern's step code as well as the machine: a change that moves costs (2:
# cpu-graph's verify reads only the slots in use; 3: other modes' entries carry their anchor, `ar_to_anchor`; 4: a
# plan timed fewer than CONFIRMED times is `unconfirmed`) gets a new number, so no cached timing of the old code is
# read.
STEP_CODE = 4


def sampling_costs(sampling: SamplingConfig, vocab: int) -> dict:
    """What of a sampling setting moves a step's cost: the support a token is drawn from (top-k 5 against the
    whole vocabulary is a different sampling and acceptance step), whether top-p sorts it, and the rows per
    image (CFG doubles every forward). Temperature and the CFG scale's value cost nothing."""
    return {"support": sampling.support_size(vocab), "top_p": sampling.top_p < 1.0,
            "rows_per_image": sampling.rows_per_image}


def calibration_key(backend: str, dtype: str, model: str, sampling: SamplingConfig, vocab: int) -> dict:
    """One calibration per machine, backend (mode), dtype, threads, model, step code and sampling cost class: a
    machine calibrated at the bundle's top-k 5 knows nothing of a step at the whole vocabulary."""
    return {"machine": machine_id(), "backend": backend, "dtype": dtype, "threads": torch.get_num_threads(),
            "model": model, "step_code": STEP_CODE, "sampling": sampling_costs(sampling, vocab)}


def pipe_key(pipe, sampling: SamplingConfig) -> dict:
    """The calibration key of this pipeline's step costs at `sampling`."""
    return calibration_key(costs_name(pipe), pipe.dtype, pipe.model_key, sampling, pipe.config.vocab_size)


def calibration_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "calibration" / f"{key['backend']}-{key['dtype']}-{digest}.json"


def calibration_problem(data: dict) -> str:
    """'' if `data` has a cached calibration's shape, else what is wrong (the entry is then measured again)."""
    wrong = field_problem(data, "key", dict) or field_problem(data, "widths", dict)
    if wrong:
        return wrong
    for width, entry in data["widths"].items():
        where = f"widths[{width!r}]"
        if not width.isdigit() or int(width) < 1:
            return f"{where}: a batch width is a whole number >= 1"
        if not isinstance(entry, dict):
            return f"{where} must be an object"
        wrong = field_problem(entry, "fixed_s", (int, float)) or field_problem(entry, "plans", dict)
        if wrong:
            return f"{where}: {wrong}"
        if not is_number(entry["fixed_s"]) or entry["fixed_s"] < 0:
            return f"{where}: fixed_s must be a finite number >= 0"
        for name, plan in entry["plans"].items():
            if not isinstance(plan, dict) or not is_number(plan.get("step_s")) or plan["step_s"] < 0:
                return f"{where}.plans[{name!r}]: step_s must be a finite number >= 0"
    return ""


def load_calibration(key: dict) -> dict:
    data = read_entry(calibration_path(key), calibration_problem)
    return data if data and data.get("key") == key else {"key": key, "widths": {}}


def save_calibration(data: dict) -> Path:
    path = calibration_path(data["key"])
    entry_folder(path.parent.name)
    write_entry(path, data)
    return path


def env_number(name: str, default: float, ok: Callable[[float], bool], allowed: str) -> float:
    """$name as a number, else `default`; a value `ok` refuses (or no number) is refused naming it and `allowed`."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ok(value):
        raise ValueError(f"{name}={text!r} is not allowed; allowed: {allowed}")
    return value


def budget_s() -> float:
    """Seconds a width's timing may take: $LANTERN_CALIBRATION_BUDGET, else BUDGET_S."""
    return env_number(BUDGET_ENV, BUDGET_S, lambda v: math.isfinite(v) and v > 0,
                      f"a finite number of seconds > 0 (default {BUDGET_S:g})")


def disturbance(entry: dict) -> str:
    """'' when the repeated runs of a width's timing agree, else how they disagree. Disturbed: the median of the
    fixed cost's repeats, or of the AR reference runs, more than DISTURBED times their fastest (a slow spell
    over half of them: a late wake-up of one run on a busy machine is noise the medians absorb), AR timed
    more than DISTURBED times away from its own reference, or a plan timed as no slower than the fixed cost."""
    def spread(values: list, what: str) -> str:
        if len(values) < 2:
            return ""
        fastest, middle = min(values), statistics.median(values)
        if fastest <= 0 or middle / fastest > DISTURBED:
            return (f"{what} took {fastest * 1e3:.3g} ms at the fastest and {middle * 1e3:.3g} ms at the median, "
                    f"more than {DISTURBED:g}x apart")
        return ""
    ar_self = entry["plans"].get(AR.name, {}).get("ratio_to_ar", [])
    ar_ratio = statistics.median(ar_self) if ar_self else 1.0
    zero = [name for name, v in entry["plans"].items() if not v.get("lower_bound") and v["step_s"] <= 0]
    return (spread(entry.get("fixed_runs_s", []), "its fixed-cost runs")
            or spread(entry.get("ar_reference_s", []), "its AR reference steps")
            or (f"AR timed at {ar_ratio:.2f}x its own reference run" if not 1 / DISTURBED <= ar_ratio <= DISTURBED
                else "")
            or (f"{', '.join(zero)} timed no slower than the fixed cost alone" if zero else ""))


def cached_or_measured(key: dict, width: int, names: Sequence[str], measure: Callable[[dict | None], dict],
                       stale: Callable[[dict], bool] = lambda entry: False, tries: int = 1) -> tuple[dict, str, str]:
    """The calibration entry at `width` holding every plan in `names`: the cached one if it does and is not
    `stale` (stale(entry): measure it again all the same, e.g. a first-run probe the request pays refining);
    else, holding the calibration's lock, the cached one read again (another process may have measured it while
    this one waited) and measure(entry or None) -> entry for what it still lacks (or, stale, anew), stored
    unless disturbed; measured anew up to `tries` times while disturbed (AHEAD_TRIES where measuring is what
    was asked for: `lantern profile calibrate`). Returns (entry, where it is cached, '' or why it was not
    stored)."""
    path = calibration_path(key)

    def lacking(entry) -> bool:
        return not entry or any(name not in entry["plans"] for name in names) or stale(entry)
    entry = load_calibration(key)["widths"].get(str(width))
    if not lacking(entry):
        return entry, str(path), ""
    entry_folder(path.parent.name)
    with entry_lock(path, f"the calibration at {width} image(s) per step"):
        data = load_calibration(key)
        entry = data["widths"].get(str(width))
        if not lacking(entry):
            return entry, str(path), ""
        cached = entry
        for attempt in range(1, tries + 1):
            entry = measure(cached)
            why = disturbance(entry)
            if not why:
                break
            # one short line; how it was disturbed is the returned `why`, which --json's plan carries
            print("lantern: calibration disturbed (another process loaded the machine?); "
                  + (f"measuring it again (try {attempt + 1} of {tries})" if attempt < tries
                     else "not cached; this run keeps AR"), file=sys.stderr)
        if why:
            return entry, str(path), why
        data["widths"][str(width)] = entry
        save_calibration(data)
    return entry, str(path), ""


def conditions(config, n: int, prompts: torch.Tensor | None = None) -> torch.Tensor | list[int]:
    """n conditions to time or record with: classes 0, 1, ... (c2i), the request's prompt rows `prompts` (P, ...)
    repeated in turn (a model-family target, whose conditions are token rows), or neutral captions (t2i)."""
    if config.model_type == "c2i":
        return [i % config.num_classes for i in range(n)]
    if config.model_type == "prompt":
        if prompts is None:
            raise ValueError("a prompt-conditioned target is timed and recorded on the request's prompt rows; "
                             "none were given")
        return prompts[torch.arange(n) % prompts.shape[0]]
    return neutral_conditions(config, n)


def _short_run(pipe, dcfg, width: int, tokens: int, attended: float = 0.5,
               prompts: torch.Tensor | None = None) -> tuple[float, int]:
    """(wall seconds, loop steps) of one chunk of `width` images generating `tokens` tokens each on the engine, every
    step attending over as many cache slots as the plan's steps do on average (`attended` of an image)."""
    runner = pipe.runner(dcfg, width)
    average = runner.spec.prefix_len + round(pipe.config.block_size * attended) + dcfg.verify_width
    with runner.attend_at_least(average):
        stats = run_batch(pipe, dcfg, width, conditions(pipe.config, width, prompts), tokens=tokens).stats
    return stats.wall_seconds, max(img.target_forwards - 1 for img in stats.images)


def _step_seconds(pipe, dcfg, width: int, fixed_s: float, tokens: int, attended: float,
                  prompts: torch.Tensor | None) -> float:
    """Seconds per loop step of a short run generating `tokens` tokens per image, its fixed cost taken off."""
    wall, ran = _short_run(pipe, dcfg, width, tokens, attended, prompts)
    return max(wall - fixed_s, 0.0) / max(ran, 1)


def ar_step_timer(pipe, sampling: SamplingConfig, width: int,
                  prompts: torch.Tensor | None = None) -> Callable[[int], float]:
    """timer(steps) -> seconds per AR loop step of `pipe` at `width` images, over a run of about `steps` steps at
    the middle of an image (its own fixed cost measured at the first call and taken off): the anchor whose runs
    another mode's calibration pairs with its AR references (measure_width), so every mode's costs can be put on
    one time scale although each was timed at another moment of a machine whose speed drifts."""
    ar, block = AR.decode(sampling), pipe.config.block_size
    fixed: list[float] = []

    def timer(steps: int) -> float:
        if not fixed:
            fixed.append(_ar_fixed_s(pipe, ar, width, prompts))
        return _step_seconds(pipe, ar, width, fixed[0], tokens_for(steps, float(block - 1), block), 0.5, prompts)
    return timer


def _ar_fixed_s(pipe, ar, width: int, prompts: torch.Tensor | None) -> float:
    """AR's runner prepared and warmed, then the fixed cost of a chunk (the median of one-token runs)."""
    compile_fused_step(pipe, ar, width, prompts)
    _short_run(pipe, ar, width, 1, prompts=prompts)
    return statistics.median(_short_run(pipe, ar, width, 1, prompts=prompts)[0] for _ in range(FIXED_REPEATS))


QUICK_AR = "quick_ar"  # a calibration file's AR estimates, per width, for requests made before any probe


def ar_estimate(pipe, sampling: SamplingConfig, width: int,
                prompts: torch.Tensor | None = None) -> tuple[dict, float]:
    """AR's costs at `width` as a calibration entry holding AR alone ({"fixed_s", "plans": {"ar": {"step_s"}}}),
    and the seconds it took to know them: this machine's calibration (at `width`, else between the widths it
    has), else the quick estimate cached with it, else timed now (a few one-token runs and one of FIRST_STEPS
    steps: a fraction of a second where a probe takes seconds) and cached. What a request's deciding credit
    (lantern.plan.deciding) is sized by before anything else is measured."""
    key = pipe_key(pipe, sampling)
    data = load_calibration(key)
    if data["widths"]:
        costs = at_width(data["widths"], width)
        return {"fixed_s": costs["fixed_s"], "plans": {AR.name: costs["plans"][AR.name]}}, 0.0
    quick = data.get(QUICK_AR, {}).get(str(width))
    if isinstance(quick, dict) and is_number(quick.get("fixed_s")) and is_number(quick.get("step_s")):
        return {"fixed_s": quick["fixed_s"], "plans": {AR.name: {"step_s": quick["step_s"], "estimate": True}}}, 0.0
    t0 = time.perf_counter()
    ar, block = AR.decode(sampling), pipe.config.block_size
    fixed = _ar_fixed_s(pipe, ar, width, prompts)
    step = _step_seconds(pipe, ar, width, fixed, tokens_for(FIRST_STEPS, float(block - 1), block), 0.5, prompts)
    path = calibration_path(key)
    entry_folder(path.parent.name)
    with entry_lock(path, "the calibration"):
        data = load_calibration(key)
        data.setdefault(QUICK_AR, {})[str(width)] = {"fixed_s": fixed, "step_s": step}
        save_calibration(data)
    return {"fixed_s": fixed, "plans": {AR.name: {"step_s": step, "estimate": True}}}, time.perf_counter() - t0


def compile_fused_step(pipe, dcfg, width: int, prompts: torch.Tensor | None = None) -> None:
    """A fused runner's step (`fused_step=True`) compiled now, by short generations: it compiles at an engine's
    first steps (lantern.engine.fused), not in the runner's warm-up, and a timed run must not pay it. Each run
    generates enough tokens for more than WARM_CALLS steps (a step emits at most its depth plus one). Other
    runners: prepared, nothing more."""
    runner = pipe.runner(dcfg, width)
    per_step = 1 if dcfg.strategy is None else dcfg.strategy.depth + 1
    tokens = min(pipe.config.block_size, (WARM_CALLS + 1) * per_step + 1)
    for _ in range(WARM_CALLS):  # one run is enough unless the image ends within its first steps
        if runner.fused_steps() is None or runner.fused_steps().fused_warm(dcfg):
            return
        _short_run(pipe, dcfg, width, tokens, prompts=prompts)


def tokens_for(steps: int, steps_per_chunk: float, block: int) -> int:
    """Tokens per image for about `steps` loop steps at the plan's whole-chunk rate (the start of an image
    accepts less, so it takes more)."""
    return max(2, min(block, round(steps * block / max(steps_per_chunk, 1.0))))


def measure_width(pipe, plans: Sequence[Plan], sampling: SamplingConfig, width: int, steps_per_chunk: dict,
                  entry: dict | None = None, progress: bool = True, attended: dict | None = None,
                  clock: Callable[[], float] = time.perf_counter, rounds: int = ROUNDS,
                  max_rounds: int = MAX_ROUNDS, budget: float | None = None,
                  prompts: torch.Tensor | None = None, anchor: Callable[[int], float] | None = None) -> dict:
    """Time every plan `entry` lacks at this width; returns the width's entry. steps_per_chunk: plan name -> the
    loop steps a chunk of `width` images needs (E[max] over its images; the block where unknown), to size the runs
    and see which plans contend; attended: plan name -> the fraction of an image its steps attend (1/2 if not given).

    Each timed run of a plan is paired with an AR run just before it (a shared machine's speed drifts for seconds
    at a time): its cost is the median of its ratios to that AR step, times AR's median step. Round 1 goes from
    the narrowest verify to the widest, FIRST_STEPS each; a plan that cannot contend even at the step cost
    (WIDER_SLACK of it) of a plan timed so far that verifies no wider and drafts nothing is kept as that
    `lower_bound`, never timed or chosen. Rounds 2..`rounds` time the contenders again (within CONTENDER of the
    best, AR always; TIMED_STEPS, alternating order), later rounds up to `max_rounds` only the plans within CLOSE
    of the best, as a close race's winner is the plan noise flatters most. No run starts that is expected to end
    past `budget` (budget_s()) of timing; a plan whose first run does not fit is kept as its floor. prompts: a
    prompt-conditioned target's rows (`conditions`). anchor (ar_step_timer of the default mode): timed before
    each AR reference when AR is timed; `ar_to_anchor` keeps the ratios (backend_choice.anchored). Preparing
    runners (exporting graphs, compiling a fused step) is counted apart (`prepare_s`); the runners stay prepared,
    so the plan chosen runs on the very runner timed (the same plan's step has differed by 10-20% between runners
    on a 2-core EPYC VM); the caller frees the others."""
    block = pipe.config.block_size
    entry = entry or {"plans": {}}
    t0 = clock()
    prepare_s = 0.0
    waited_s = 0.0  # waiting for a turn (sharing_cores): neither timing nor preparing
    ar = AR.decode(sampling)
    attended_by_plan = attended or {}
    took: dict[str, float] = {}  # plan -> seconds per loop step its last timed run (with its AR reference) took
    ar_own: list[float] = []  # AR's runs as a plan: more AR steps, like its references
    reference_took: list[float] = []  # seconds per loop step each AR reference run took, its fixed cost included

    def prepare(dcfg) -> None:
        nonlocal prepare_s
        t = clock()
        compile_fused_step(pipe, dcfg, width, prompts)  # the runner, and its fused step if it has one
        prepare_s += clock() - t

    budget = budget_s() if budget is None else budget

    def fits(seconds: float) -> bool:
        return clock() - t0 - prepare_s - waited_s + seconds <= budget

    @contextlib.contextmanager
    def turn():
        """A timed block, run in a turn of the cores when calibration shares them (sharing_cores)."""
        nonlocal waited_s
        t = clock()
        with _turn():
            waited_s += clock() - t
            yield

    prepare(ar)
    if "fixed_s" not in entry:
        _short_run(pipe, ar, width, 1, prompts=prompts)
        with turn():
            entry["fixed_runs_s"] = [_short_run(pipe, ar, width, 1, prompts=prompts)[0]
                                     for _ in range(FIXED_REPEATS)]
        entry["fixed_s"] = statistics.median(entry["fixed_runs_s"])
    todo = [p for p in plans if p.name not in entry["plans"]]
    decoded = {p.name: p.decode(sampling) for p in todo}  # each plan's config, compiled once
    width_of = {p.name: decoded[p.name].verify_width for p in todo}
    todo.sort(key=lambda p: width_of[p.name])
    ar_steps: list[float] = []
    ratios: dict[str, list[float]] = {p.name: [] for p in todo}
    anchor = anchor if any(p == AR for p in todo) else None  # the entry's AR is timed now, or not anchored
    to_anchor: list[float] = []  # each AR reference's ratio to the anchor's AR step, timed just before it

    def step_seconds(dcfg, per_chunk: float, steps: int, fraction: float) -> float:
        return _step_seconds(pipe, dcfg, width, entry["fixed_s"], tokens_for(steps, per_chunk, block), fraction,
                             prompts)

    def time_plan(plan: Plan, steps: int) -> None:
        dcfg, per_chunk = decoded[plan.name], steps_per_chunk.get(plan.name, float(block))
        fraction = attended_by_plan.get(plan.name, 0.5)
        if not ratios[plan.name]:
            prepare(dcfg)
            _short_run(pipe, dcfg, width, 2, fraction, prompts)  # warm this runner's first steps
        with turn():
            start = clock()
            anchor_s = anchor(steps) if anchor is not None else 0.0
            ref_start = clock()
            reference = step_seconds(ar, float(block - 1), steps, 0.5)
            reference_took.append((clock() - ref_start) / steps)
            ar_steps.append(reference)
            if anchor is not None:
                to_anchor.append(reference / max(anchor_s, 1e-9))
            seconds = step_seconds(dcfg, per_chunk, steps, fraction)
            ratios[plan.name].append(seconds / max(reference, 1e-9))
            if plan == AR:
                ar_own.append(seconds)
            took[plan.name] = (clock() - start) / steps

    def per_chunk_s(name: str, ratio: float) -> float:
        return ratio * statistics.median(ar_steps) * steps_per_chunk.get(name, block)

    def confirm_leader(measured: list[Plan]) -> None:
        """Time the plan that leads AR (by its median so far) until it has CONFIRMED runs, while they fit; a
        leader that falls behind passes the lead to the next. What a choice hinges on is timed first."""
        while True:
            median = {p.name: per_chunk_s(p.name, statistics.median(ratios[p.name])) for p in measured}
            leader = min((p for p in measured if p != AR), key=lambda p: median[p.name], default=None)
            if (leader is None or median[leader.name] >= median.get(AR.name, math.inf)
                    or len(ratios[leader.name]) >= min(CONFIRMED, max_rounds)
                    or not fits(took[leader.name] * TIMED_STEPS)):
                return
            bar.set_postfix_str(leader.name)
            time_plan(leader, TIMED_STEPS)
            tick()

    def confirming_s() -> float:
        """Seconds to time the leader so far (a plan, not AR) up to CONFIRMED runs: round 1 leaves them."""
        timed = [p for p in todo if ratios[p.name] and p != AR]
        if not timed:
            return 0.0
        leader = min(timed, key=lambda p: per_chunk_s(p.name, ratios[p.name][0]))
        return max(CONFIRMED - len(ratios[leader.name]), 0) * took[leader.name] * TIMED_STEPS

    known = [v["step_s"] * steps_per_chunk.get(name, block) for name, v in entry["plans"].items()
             if not v.get("lower_bound")]
    floors: dict[str, float] = {}  # plan -> the step ratio to AR it costs at least
    # progress in seconds of timing against the budget: how many runs it takes depends on what they measure
    bar = tqdm(total=budget, desc=f"calibrating {width} image(s) per step", file=sys.stderr,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s{postfix}",
               disable=not progress or not todo)

    def tick() -> None:
        bar.n = min(clock() - t0 - prepare_s - waited_s, budget)
        bar.refresh()
    try:
        first_run = 0.0  # seconds the last first run took, warm-up included
        for plan in todo:  # round 1, narrowest verify first
            bar.set_postfix_str(plan.name)
            timed = [p for p in todo if ratios[p.name]]
            floor = WIDER_SLACK * dearest_no_wider(((width_of[p.name], ratios[p.name][0]) for p in timed
                                                    if not decoded[p.name].needs_drafter), width_of[plan.name])
            best = min([per_chunk_s(p.name, ratios[p.name][0]) for p in timed] + known, default=math.inf)
            if plan != AR and timed and (per_chunk_s(plan.name, floor) > CONTENDER * best
                                         or not fits(first_run + confirming_s())):
                floors[plan.name] = floor
            else:
                start, prepared, waited = clock(), prepare_s, waited_s
                time_plan(plan, FIRST_STEPS)
                first_run = clock() - start - (prepare_s - prepared) - (waited_s - waited)  # with its warm-up
            tick()
        measured = [p for p in todo if ratios[p.name]]
        if measured:
            estimate = {p.name: per_chunk_s(p.name, ratios[p.name][0]) for p in measured}
            best = min([*estimate.values(), *known])
            contenders = [p for p in measured if p == AR or estimate[p.name] <= CONTENDER * best]
            confirm_leader(measured)
            r, out_of_time = 1, False
            while contenders and r < max_rounds and not out_of_time:
                if r >= rounds:
                    estimate = {p.name: per_chunk_s(p.name, statistics.median(ratios[p.name])) for p in measured}
                    best = min(estimate[p.name] for p in contenders)
                    contenders = [p for p in contenders if estimate[p.name] <= CLOSE * best]  # the leader at least
                for plan in (contenders if r % 2 else contenders[::-1]):  # alternating order
                    if len(ratios[plan.name]) > r:  # timed this round already (confirm_leader)
                        continue
                    if not fits(took[plan.name] * TIMED_STEPS):
                        out_of_time = True
                        break
                    bar.set_postfix_str(plan.name)
                    time_plan(plan, TIMED_STEPS)
                    tick()
                r += 1
            if len(ar_steps) < 2 or fits(statistics.median(reference_took) * TIMED_STEPS):
                # a closing reference: the load at the end of the timing against its start (`disturbance`)
                with turn():
                    ar_steps.append(step_seconds(ar, float(block - 1), TIMED_STEPS, 0.5))
            entry["ar_reference_s"] = list(ar_steps)
            if to_anchor:
                entry["ar_to_anchor"] = [round(x, 4) for x in to_anchor]
            ar_s = statistics.median(ar_steps + ar_own)
            for plan in measured:
                entry["plans"][plan.name] = {"step_s": statistics.median(ratios[plan.name]) * ar_s if plan != AR
                                             else ar_s, "ratio_to_ar": [round(x, 4) for x in ratios[plan.name]],
                                             "attended": attended_by_plan.get(plan.name, 0.5),
                                             **({"unconfirmed": True} if plan != AR
                                                and len(ratios[plan.name]) < CONFIRMED else {})}
            for name, floor in floors.items():
                entry["plans"][name] = {"step_s": floor * ar_s, "lower_bound": True}
        tick()
        bar.total = bar.n  # done: it ends full, at the seconds it took
    finally:  # closed before an error is reported, so the message is the last line
        bar.close()
    entry["seconds"] = entry.get("seconds", 0.0) + clock() - t0 - prepare_s - waited_s
    entry["prepare_s"] = entry.get("prepare_s", 0.0) + prepare_s
    entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return entry


def refresh_cache(pipe, sampling: SamplingConfig, width: int, entry: dict) -> Path:
    """Store a width's entry (e.g. from `lantern profile run`) as this machine's calibration of `pipe` at
    `sampling`."""
    data = load_calibration(pipe_key(pipe, sampling))
    data["widths"][str(width)] = entry
    return save_calibration(data)


def at_width(widths: dict, width: int) -> dict:
    """The entry for `width` from entries measured at other widths (keys are str(width)): exact if measured,
    else per plan linear in the width between the two nearest measured ones (cost_model.interpolate)."""
    if str(width) in widths:
        return widths[str(width)]
    have = sorted(int(w) for w in widths)
    if not have:
        raise ValueError("no calibration at any batch width")
    if len(have) == 1:
        return widths[str(have[0])]
    lo, hi = (have[i] for i in bracket(have, width))
    a, b = widths[str(lo)], widths[str(hi)]

    def lerp(x: float, y: float) -> float:
        return interpolate(((lo, x), (hi, y)), width)

    plans = {name: {"step_s": lerp(a["plans"][name]["step_s"], b["plans"][name]["step_s"]),
                    **{flag: True for flag in ("lower_bound", "unconfirmed")
                       if a["plans"][name].get(flag) or b["plans"][name].get(flag)}}
             for name in a["plans"] if name in b["plans"]}
    return {"fixed_s": lerp(a["fixed_s"], b["fixed_s"]), "plans": plans, "interpolated_from": [lo, hi]}
