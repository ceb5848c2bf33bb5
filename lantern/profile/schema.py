"""The results file: one versioned JSON object per (profile, machine) run, validated on every load.

Schema version 2 (`"schema": "lantern-profile-results"`, `"schema_version": 2`):

    profile        the HardwareProfile as run (every field, defaults included), plus settings_hash
    backend        {"requested", "name", "available", "reason", "capabilities"}
    model          the ModelSource record: kind (bundle | random), name, config, note
    environment    CPU model, cores, accelerator, driver, python/torch/onnxruntime versions, lantern version
                   and git revision, hostname, platform
    provenance     {"machine", "commit", "command", "missing"}: what every committed results file names
                   (lantern.backends.environment.provenance)
    started_at, updated_at   ISO-8601 UTC
    complete       true once every planned case has a record
    cases          {case_id: case}; the case ids, B being the images per step (a batch size of the profile):
                     "verify/b{B}/N{N}"       one target verify step over N tree nodes (root included)
                     "draft/b{B}/W{W}"        one drafter step of width W
                     "generate/b{B}/{method}"         B images decoded together (one batched loop), e.g.
                     "generate/b{B}/{method}/{tree}"  "generate/b4/ar", "generate/b4/lantern++/chain-5"
                                              (static-tree methods once per tree)
                     "calibration/b{B}"       `--method auto`'s cost model at B: fixed_s and each candidate
                                              plan's step_s (lantern.plan.calibration), also cached for the machine
                   (the second part of a step or generate id is always "b" and the batch size)

A case is {"kind": verify | draft | generate | calibration | backend, "status": ok | failed,
"params": {...}, "result": {...} (ok) or "error": "..." (failed), "seconds": wall time of the case,
"measured_at": ISO time, "load_average": the 1/5/15-minute load when the case ended}. Every step, generate and
calibration case has params["batch"] = B.
Latencies are {"median_s", "min_s", "max_s", "p25_s", "p75_s", "repeats", "samples_s"}; memory is the
backend's MemoryReport: the true peak (lantern.backends.memory; its "source" says which) and its parts. Files
measured before it also hold "process_peak_rss_bytes" (the process's lifetime peak), and files measured while
lantern had `lantern profile tune` its "tune" object, "acceptance/probe" case (kind "acceptance") and tuned trees'
"generate/bB/lantern++/tuned-N{N}-{hash}" cases, which nothing reads now.
A generate result holds "wall" (a latency record over the timed passes, each pass decoding the B images once),
"images" (B), "tokens_per_pass", "tokens_per_s" (all images' tokens over all passes' wall time), "tau" (per
image and verify step), "step_compression" (per image), "verify_steps" (steps of the batched loop, each
advancing all B images, summed over the passes), the tree's shape, phase times and memory.

    migrated_from  (optional) what a file upgraded from version 1 by an earlier lantern lacks

A file of any other version (version 1 timed whole generations one image at a time) is refused, naming the
command that measures it again.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from lantern.files import atomic_io
from lantern.files.reading import read_json

SCHEMA = "lantern-profile-results"
SCHEMA_VERSION = 2
CASE_KINDS = ("backend", "verify", "draft", "generate", "acceptance", "calibration")
BATCHED_KINDS = ("verify", "draft", "generate")  # measured per batch size: params["batch"]
CASE_STATUSES = ("ok", "failed")
RESULT_FIELDS = {"backend": (), "verify": ("latency", "memory"), "draft": ("latency", "memory"),
                 "generate": ("wall", "images", "verify_steps"), "acceptance": (),
                 "calibration": ("fixed_s", "plans")}  # what the report and auto read of an ok case
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
        name = (data.get("profile") or {}).get("name", "NAME")
        raise SchemaError(f"{where}: results schema version {version!r} is incompatible; this lantern reads "
                          f"version {SCHEMA_VERSION} only (measure again with `lantern profile run --profile {name} "
                          f"--fresh`, or read the file with the lantern that wrote it)")
    for key, typ in TOP_LEVEL.items():
        if not isinstance(data.get(key), typ):
            raise SchemaError(f"{where}: field {key!r} must be a {typ.__name__}, got {data.get(key)!r:.80}")
    for case_id, case in data["cases"].items():
        _validate_case(case_id, case, where)
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
    batch = case["params"].get("batch")
    if case["kind"] in BATCHED_KINDS and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise SchemaError(f"{where}: {case['kind']} case {case_id!r} needs params.batch, an integer >= 1 (images per "
                          f"step), got {batch!r}")
    if status == "ok" and not isinstance(case.get("result"), dict):
        raise SchemaError(f"{where}: ok case {case_id!r} has no result object")
    if status == "ok":
        for name in RESULT_FIELDS[case["kind"]]:
            if not isinstance(case["result"].get(name), (dict, list, int, float)):
                raise SchemaError(f"{where}: ok case {case_id!r} has no result field {name!r}")
    if status == "failed" and not isinstance(case.get("error"), str):
        raise SchemaError(f"{where}: failed case {case_id!r} has no error message")


def load_results(path: str | Path) -> dict:
    return validate(read_json(path, "results file"), str(path))


def save_results(data: dict, path: str | Path) -> None:
    """Validate, then write atomically (a crash mid-write never leaves half a file to resume from)."""
    path = Path(path)
    validate(data, str(path))
    atomic_io.write_json(path, data)


# -- case ids (the scheme is in the module doc) -------------------------------------------------------------------
def step_case_id(kind: str, batch: int, size: int) -> str:
    return f"{kind}/b{batch}/{STEP_SIZE[kind]}{size}"


def generation_case_id(batch: int, method: str, tree: Optional[str] = None) -> str:
    return f"generate/b{batch}/{method}" + (f"/{tree}" if tree else "")


# -- reading: the one place the report and auto take measurements from -----------------------------------------------
def ok_cases(data: dict, kind: str) -> dict[str, dict]:
    return {cid: c for cid, c in data["cases"].items() if c["kind"] == kind and c["status"] == "ok"}


def ok_result(data: dict, case_id: str) -> Optional[dict]:
    case = data["cases"].get(case_id)
    return case["result"] if case and case["status"] == "ok" else None


def step_latencies(data: dict, kind: str, batch: int) -> dict[int, dict]:
    """{N or W: latency record} of the ok verify or draft cases at `batch` images, by size."""
    size = STEP_SIZE[kind]
    return dict(sorted((c["params"][size], c["result"]["latency"]) for c in ok_cases(data, kind).values()
                       if c["params"]["batch"] == batch))


def batch_sizes(data: dict, kind: str) -> list[int]:
    """The batch sizes with an ok case of `kind` (verify, draft or generate), ascending."""
    return sorted({c["params"]["batch"] for c in ok_cases(data, kind).values()})


def seconds_per_step(result: dict) -> float:
    """Wall seconds per step of a generate case's (batched) decode loop, over all its timed passes."""
    return sum(result["wall"]["samples_s"]) / max(result["verify_steps"], 1)


def calibration_entries(data: dict) -> dict[str, dict]:
    """{str(B): calibration entry} of the ok calibration cases (`--method auto --profile NAME` reads these)."""
    return {str(c["params"]["batch"]): c["result"] for c in ok_cases(data, "calibration").values()}
