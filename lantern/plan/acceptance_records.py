"""Acceptance records: how many steps each image of a model needs under each plan, at given sampling settings.

A plan's steps per image do not depend on how many images share a step (batched images get the tokens they get
alone), and the device changes them only through numerics: one record serves every backend and batch width of
a dtype. (On the embedded model bf16 needs 1-4% more steps than fp32, Jacobi windows the most.) It is a model
property, measured from whole generations:

    {"model": model hash, "sampling": SamplingConfig fields, "dtype": ..., "seed": first seed, "conditions": [...],
     "plans": {plan name: {"steps": [steps of image 1, ...], "conditions": [class id of image 1, ...],
                           "tau": ..., "step_compression": ..., "decode": the plan's decode settings, sampling
                           aside}}}

(An entry without its own "conditions" has the record's.) Some classes are easier to speculate on than others,
so a request's images are predicted from their own classes' steps (`per_image_steps`).

An entry counts only while its plan still decodes with the settings it was measured with (a changed default,
e.g. of the Jacobi drafts, makes it stale: it is measured again).

A bundle may ship them for its default sampling, per dtype (manifest key "acceptance_records": {dtype: record});
a dtype it ships none for uses fp32's. Records measured on this machine live in the user cache
(records/<model>-<sampling>-<dtype>.json). AR needs no record: block - 1 steps.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from lantern.decoding.sampling import SamplingConfig
from lantern.plan.candidates import AR, Plan
from lantern.files.user_cache import cache_root, entry_folder, entry_lock, field_problem, read_entry, write_entry


def sampling_key(sampling: SamplingConfig) -> str:
    return hashlib.sha256(json.dumps(asdict(sampling), sort_keys=True).encode()).hexdigest()[:16]


def record_path(model: str, sampling: SamplingConfig, dtype: str) -> Path:
    return cache_root() / "records" / f"{model[:16]}-{sampling_key(sampling)}-{dtype}.json"


def empty_record(model: str, sampling: SamplingConfig, dtype: str) -> dict:
    return {"model": model, "sampling": asdict(sampling), "dtype": dtype, "plans": {}}


def matches(record: Optional[dict], model: str, sampling: SamplingConfig) -> bool:
    return bool(record) and record.get("model") == model and record.get("sampling") == asdict(sampling)


def shipped_for(shipped: Optional[dict], dtype: str) -> Optional[dict]:
    """A bundle's records by dtype -> the one for `dtype`, else fp32's (the reference numerics), else any other
    dtype's (numerics aside, the same model), else None."""
    shipped = shipped or {}
    return shipped.get(dtype) or shipped.get("fp32") or next(iter(shipped.values()), None)


def record_problem(data: dict) -> str:
    """'' if `data` has a cached acceptance record's shape, else what is wrong (it is then measured again)."""
    wrong = (field_problem(data, "model", str) or field_problem(data, "sampling", dict)
             or field_problem(data, "dtype", str) or field_problem(data, "plans", dict))
    if wrong:
        return wrong
    for name, entry in data["plans"].items():
        steps = entry.get("steps") if isinstance(entry, dict) else None
        if (not isinstance(steps, list) or not steps
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in steps)):
            return f"plans[{name!r}]: steps must be a non-empty list of whole numbers >= 0"
        if entry.get("conditions") is not None and not isinstance(entry["conditions"], list):
            return f"plans[{name!r}]: conditions must be a list or null"
    return ""


def locked(model: str, sampling: SamplingConfig, dtype: str):
    """The record's lock (lantern.files.user_cache.entry_lock): one process measures it at a time."""
    path = record_path(model, sampling, dtype)
    entry_folder(path.parent.name)
    return entry_lock(path, "an acceptance record")


def load_record(model: str, sampling: SamplingConfig, dtype: str, shipped: Optional[dict] = None) -> dict:
    """The cached record for `dtype` merged over the bundle's shipped one (`shipped`: its records by dtype; see
    `shipped_for`), each only if it is for this model and sampling."""
    out = empty_record(model, sampling, dtype)
    for rec in (shipped_for(shipped, dtype), read_entry(record_path(model, sampling, dtype), record_problem)):
        if matches(rec, model, sampling):
            out["plans"].update({name: {"conditions": rec.get("conditions"), **entry}
                                 for name, entry in rec["plans"].items()})
    return out


def decode_settings(plan: Plan, sampling: SamplingConfig) -> dict:
    """What an entry of the plan was measured with: its decode config without the sampling (the record's key)."""
    return {key: value for key, value in plan.decode(sampling).to_dict().items() if key != "sampling"}


def current(record: dict, plan: Plan) -> bool:
    entry = record["plans"].get(plan.name)
    return bool(entry) and entry.get("decode") == decode_settings(plan, SamplingConfig(**record["sampling"]))


def plan_steps(record: dict, plan: Plan, block: int) -> Optional[list[int]]:
    if plan == AR:
        return [block - 1]
    return list(record["plans"][plan.name]["steps"]) if current(record, plan) else None


def plan_conditions(record: dict, plan: Plan) -> Optional[list]:
    """The class id of each image of the plan's entry, or None when the record does not say (or is not c2i)."""
    entry = record["plans"].get(plan.name, {})
    conds = entry.get("conditions")
    return list(conds) if conds is not None and len(conds) == len(entry.get("steps", ())) else None


def per_image_steps(steps: Sequence[int], conds: Optional[Sequence], wanted: Sequence) -> list[list[float]]:
    """Each requested image's steps, as equally likely values. steps/conds: a record entry's images and their
    classes (conds None: unknown); wanted: the request's class ids (None for an image of unknown class).

    A class's mean from a couple of images is mostly noise, so it is shrunk toward the mean of all images by
    how much classes really differ (empirical Bayes): with within-class variance s2 (pooled), n_c images of
    class c and between-class variance t2 (the variance of the class means less the noise s2 / n_c they carry),
    class c's mean is mu + w (mean_c - mu), w = t2 / (t2 + s2 / n_c). Its values are that mean plus the
    within-class deviations of every class (scaled by sqrt(n / (n - 1)), so their variance is s2). An image
    of a class the record lacks, or of unknown class, gets all the record's values."""
    pooled = [float(x) for x in steps]
    groups: dict = {}
    for x, c in zip(steps, conds or ()):
        groups.setdefault(c, []).append(float(x))
    repeated = {c: g for c, g in groups.items() if len(g) > 1}
    if len(groups) < 2 or not repeated:
        return [pooled for _ in wanted]
    mu = statistics.fmean(pooled)
    means = {c: statistics.fmean(g) for c, g in groups.items()}
    s2 = sum((x - means[c]) ** 2 for c, g in repeated.items() for x in g) / sum(len(g) - 1 for g in repeated.values())
    t2 = max(statistics.variance(means.values()) - statistics.fmean(s2 / len(g) for g in groups.values()), 0.0)
    deviations = [(x - means[c]) * math.sqrt(len(g) / (len(g) - 1)) for c, g in repeated.items() for x in g]
    out = []
    for c in wanted:
        if c not in groups:
            out.append(pooled)
            continue
        w = t2 / (t2 + s2 / len(groups[c])) if t2 > 0 else 0.0
        centre = mu + w * (means[c] - mu)
        out.append([centre + d for d in deviations])
    return out


def measure_record(generate: Callable[[Plan], object], plans: Sequence[Plan], record: dict,
                   classes: Optional[list[int]] = None, progress: bool = True) -> dict:
    """Fill `record` with every plan it lacks or holds stale. generate(plan) -> a run of whole images with their
    `stats` (lantern.engine.BatchRun; the same conditions and seeds for every plan); classes: their class ids
    (c2i; None: t2i), kept with the steps. Returns the record (saved to the cache by the caller)."""
    sampling = SamplingConfig(**record["sampling"])
    todo = [p for p in plans if p != AR and not current(record, p)]
    for plan in tqdm(todo, desc="acceptance record", unit="plan", file=sys.stderr, disable=not progress or not todo):
        s = generate(plan).stats
        record["plans"][plan.name] = {"steps": [img.target_forwards - 1 for img in s.images],
                                      "conditions": classes,
                                      "tau": s.mean_accepted_length, "step_compression": s.step_compression,
                                      "decode": decode_settings(plan, sampling)}
    return record


def save_record(record: dict) -> Path:
    path = record_path(record["model"], SamplingConfig(**record["sampling"]), record["dtype"])
    entry_folder(path.parent.name)
    write_entry(path, record)
    return path


def expected_max(images: Sequence[Sequence[float]]) -> float:
    """E[max over a chunk's images of their steps], each image's steps an independent draw from its own
    equally likely values: a chunk runs until its slowest image is done. P(max <= x) = prod_i F_i(x)."""
    ordered = [sorted(values) for values in images]  # F_i(x) by bisection: auto runs this per plan and chunk
    total, below = 0.0, 0.0
    for x in sorted({v for values in ordered for v in values}):
        at_most = math.prod(bisect.bisect_right(values, x) / len(values) for values in ordered)
        total += x * (at_most - below)
        below = at_most
    return total


def expected_min(images: Sequence[Sequence[float]]) -> float:
    """E[min over a chunk's images of their steps] (the first image done), as expected_max."""
    return -expected_max([[-v for v in values] for values in images])


def attended_fraction(images: Sequence[Sequence[float]]) -> float:
    """The mean fraction of an image's tokens a chunk's steps attend over on a runner that attends up to the
    furthest image: until the first image is done that is the first image's progress (from 0 to 1), then
    all of it (a done image pads at full length): 1 - E[min] / (2 E[max]). One image, or images in lockstep
    (AR): 1/2, the middle."""
    return 1.0 - expected_min(images) / (2.0 * expected_max(images))


def chunk_timing(images: dict[str, Sequence[Sequence[float]]]) -> tuple[dict[str, float], dict[str, float]]:
    """What calibration.measure_width sizes and times each plan's runs by, from the steps of a chunk's images
    (plan name -> each image's steps): the chunk's loop steps (expected_max) and the fraction of an image its
    steps attend (attended_fraction)."""
    return ({name: expected_max(v) for name, v in images.items()},
            {name: attended_fraction(v) for name, v in images.items()})
