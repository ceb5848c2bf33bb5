"""Acceptance records: how many steps each image of a model needs under each plan, at given sampling settings.

A plan's steps per image do not depend on the device or on how many images share a step (batched images get
the tokens they get alone), so one record serves every backend and batch width. It is a model property,
measured from whole generations:

    {"model": model hash, "sampling": SamplingConfig fields, "seed": first seed, "conditions": [...],
     "plans": {plan name: {"steps": [steps of image 1, ...], "tau": ..., "step_compression": ...,
                           "decode": the plan's decode settings, sampling aside}}}

An entry counts only while its plan still decodes with the settings it was measured with (a changed default,
e.g. of the Jacobi drafts, makes it stale: it is measured again).

A bundle may ship one for its default sampling (manifest key "acceptance_record"); records measured on this
machine live in the user cache (records/<model>-<sampling>.json). AR needs no record: block - 1 steps.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional, Sequence

from lantern.decoding.sampling import SamplingConfig
from lantern.plan.candidates import AR, Plan
from lantern.user_cache import cache_root, read_json, write_json


def sampling_key(sampling: SamplingConfig) -> str:
    return hashlib.sha256(json.dumps(asdict(sampling), sort_keys=True).encode()).hexdigest()[:16]


def record_path(model: str, sampling: SamplingConfig) -> Path:
    return cache_root() / "records" / f"{model[:16]}-{sampling_key(sampling)}.json"


def empty_record(model: str, sampling: SamplingConfig) -> dict:
    return {"model": model, "sampling": asdict(sampling), "plans": {}}


def matches(record: Optional[dict], model: str, sampling: SamplingConfig) -> bool:
    return bool(record) and record.get("model") == model and record.get("sampling") == asdict(sampling)


def load_record(model: str, sampling: SamplingConfig, shipped: Optional[dict] = None) -> dict:
    """The cached record merged over the bundle's shipped one (each only if it is for this model and sampling)."""
    out = empty_record(model, sampling)
    for rec in (shipped, read_json(record_path(model, sampling))):
        if matches(rec, model, sampling):
            out["plans"].update(rec["plans"])
    return out


def decode_settings(plan: Plan, sampling: SamplingConfig) -> dict:
    """What an entry of the plan was measured with: its decode config without the sampling (the record's key)."""
    settings = plan.decode(sampling).to_dict()
    del settings["sampling"]
    return settings


def current(record: dict, plan: Plan) -> bool:
    entry = record["plans"].get(plan.name)
    return bool(entry) and entry.get("decode") == decode_settings(plan, SamplingConfig(**record["sampling"]))


def plan_steps(record: dict, plan: Plan, block: int) -> Optional[list[int]]:
    if plan == AR:
        return [block - 1]
    return list(record["plans"][plan.name]["steps"]) if current(record, plan) else None


def mean_steps(record: Optional[dict]) -> dict[str, float]:
    """Mean steps per image of every plan in a record."""
    return {name: sum(e["steps"]) / len(e["steps"]) for name, e in (record or {}).get("plans", {}).items()}


def measure_record(generate: Callable[[Plan], object], plans: Sequence[Plan], record: dict,
                   progress: bool = True) -> dict:
    """Fill `record` with every plan it lacks or holds stale. generate(plan) -> a GenerationResult of whole images
    (the same conditions and seed for every plan). Returns the record (saved to the cache by the caller)."""
    from tqdm import tqdm
    sampling = SamplingConfig(**record["sampling"])
    todo = [p for p in plans if p != AR and not current(record, p)]
    for plan in tqdm(todo, desc="acceptance record", unit="plan", file=sys.stderr, disable=not progress or not todo):
        result = generate(plan)
        s = result.stats
        record["plans"][plan.name] = {"steps": [img.target_forwards - 1 for img in s.images],
                                      "tau": s.mean_accepted_length, "step_compression": s.step_compression,
                                      "decode": decode_settings(plan, sampling)}
    return record


def save_record(record: dict) -> Path:
    path = record_path(record["model"], SamplingConfig(**record["sampling"]))
    write_json(path, record)
    return path


def expected_max(steps: Sequence[int], k: int) -> float:
    """E[max of k independent draws] from the empirical distribution of `steps`: a chunk of k images runs until
    its slowest image is done. With sorted x_1 <= ... <= x_m: sum_j x_j ((j/m)^k - ((j-1)/m)^k)."""
    xs = sorted(steps)
    m = len(xs)
    return sum(x * ((j / m) ** k - ((j - 1) / m) ** k) for j, x in enumerate(xs, start=1))
