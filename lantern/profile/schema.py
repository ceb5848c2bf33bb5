"""The results file: one versioned JSON object per (profile, machine) run, validated on every load.

Schema version 1 (`"schema": "lantern-profile-results"`, `"schema_version": 1`):

    profile        the HardwareProfile as run (every field, defaults included), plus settings_hash
    backend        {"requested", "name", "available", "reason", "capabilities"}
    model          the ModelSource record: kind (bundle | random), name, config, note
    environment    CPU model, cores, accelerator, driver, python/torch/onnxruntime versions, lantern version
                   and git revision, hostname, platform
    started_at, updated_at   ISO-8601 UTC
    complete       true once every planned case has a record
    cases          {case_id: case}, case ids like "verify/b1/N58", "draft/b1/W10", "generate/ar",
                   "generate/lantern++/lantern++-57", "acceptance/probe"
    tune           (optional) the last `lantern profile tune` choice and its side-by-side measurement

A case is {"kind": verify | draft | generate | acceptance | backend, "status": ok | failed,
"params": {...}, "result": {...} (ok) or "error": "..." (failed), "seconds": wall time of the case,
"measured_at": ISO time, "load_average": the 1/5/15-minute load when the case ended}.
Latencies are {"median_s", "min_s", "max_s", "p25_s", "p75_s", "repeats", "samples_s"}; memory is the
backend's MemoryReport plus the process's peak RSS.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

SCHEMA = "lantern-profile-results"
SCHEMA_VERSION = 1
CASE_KINDS = ("backend", "verify", "draft", "generate", "acceptance")
CASE_STATUSES = ("ok", "failed")
STEP_SIZE = {"verify": "N", "draft": "W"}  # the param that sizes a step case
TOP_LEVEL = {"schema": str, "schema_version": int, "profile": dict, "backend": dict, "model": dict,
             "environment": dict, "started_at": str, "updated_at": str, "complete": bool, "cases": dict}


class SchemaError(ValueError):
    """A results file this lantern cannot read; the message names the file and what is wrong."""


def validate(data, where: str) -> dict:
    if not isinstance(data, dict):
        raise SchemaError(f"{where}: a results file is a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise SchemaError(f"{where}: not a lantern profile results file (schema {data.get('schema')!r}, "
                          f"expected {SCHEMA!r})")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{where}: results schema version {version!r} is incompatible; this lantern reads "
                          f"version {SCHEMA_VERSION} only (rerun `lantern profile run` with this lantern, or "
                          f"read the file with the lantern that wrote it)")
    for key, typ in TOP_LEVEL.items():
        if not isinstance(data.get(key), typ):
            raise SchemaError(f"{where}: field {key!r} must be a {typ.__name__}, got {data.get(key)!r:.80}")
    for case_id, case in data["cases"].items():
        _validate_case(case_id, case, where)
    if "tune" in data and not isinstance(data["tune"], dict):
        raise SchemaError(f"{where}: field 'tune' must be an object")
    return data


def _validate_case(case_id: str, case, where: str) -> None:
    if not isinstance(case, dict):
        raise SchemaError(f"{where}: case {case_id!r} must be an object")
    if case.get("kind") not in CASE_KINDS:
        raise SchemaError(f"{where}: case {case_id!r} has kind {case.get('kind')!r}; allowed: {', '.join(CASE_KINDS)}")
    status = case.get("status")
    if status not in CASE_STATUSES:
        raise SchemaError(f"{where}: case {case_id!r} has status {status!r}; allowed: {', '.join(CASE_STATUSES)}")
    if not isinstance(case.get("params"), dict):
        raise SchemaError(f"{where}: case {case_id!r} has no params object")
    if status == "ok" and not isinstance(case.get("result"), dict):
        raise SchemaError(f"{where}: ok case {case_id!r} has no result object")
    if status == "failed" and not isinstance(case.get("error"), str):
        raise SchemaError(f"{where}: failed case {case_id!r} has no error message")


def load_results(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"results file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SchemaError(f"{path}: not valid JSON ({e})") from None
    return validate(data, str(path))


def save_results(data: dict, path: str | Path) -> None:
    """Validate, then write atomically (a crash mid-write never leaves half a file to resume from)."""
    path = Path(path)
    validate(data, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the results from the other users of a shared box
    os.replace(tmp, path)


# -- reading: the one place the tuner and the report take measurements from -------------------------------------
def ok_cases(data: dict, kind: str) -> dict[str, dict]:
    return {cid: c for cid, c in data["cases"].items() if c["kind"] == kind and c["status"] == "ok"}


def ok_result(data: dict, case_id: str) -> Optional[dict]:
    case = data["cases"].get(case_id)
    return case["result"] if case and case["status"] == "ok" else None


def step_latencies(data: dict, kind: str, batch: int = 1) -> dict[int, dict]:
    """{N or W: latency record} of the ok verify or draft cases at `batch` images, by size."""
    size = STEP_SIZE[kind]
    return dict(sorted((c["params"][size], c["result"]["latency"]) for c in ok_cases(data, kind).values()
                       if c["params"]["batch"] == batch))


def seconds_per_step(result: dict) -> float:
    """Wall seconds per target step of a generate case, over all its timed passes."""
    return sum(result["wall"]["samples_s"]) / max(result["verify_steps"], 1)
