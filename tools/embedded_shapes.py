"""The embedded bundle's models at a benchmark's shape: as trained, or inflated to LlamaGen's compute shapes."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from lantern.bundle import load_bundle
from lantern.models.inflate import inflate_models
from results_io import utc_now
from samplings import describe, sampling_settings


def models(shape: str):
    """The embedded bundle and its target, drafter and proximity table, or them inflated to `shape`
    ("embedded": as they are)."""
    bundle = load_bundle()
    if shape == "embedded":
        return bundle, (bundle.target, bundle.drafter, bundle.proximity)
    inflated = inflate_models(bundle.target, bundle.drafter, bundle.proximity, shape)
    return bundle, (inflated.target, inflated.drafter, inflated.proximity)


def count_record(shape: str, dtype: str, sampling_names, before: str | None):
    """What a counting tool (bench_step_ops, bench_step_kernels) starts from: the bundle, its models at `shape`, the
    samplings named, and the record's head, with the rows of an earlier record `before` (a path) beside it."""
    bundle, three = models(shape)
    settings = sampling_settings(bundle.default_sampling, sampling_names)
    record = {"date": utc_now(), "dtype": dtype, "shape": shape, "torch": torch.__version__,
              "samplings": {n: describe(s) for n, s in settings.items()}, "rows": []}
    if before:
        earlier = json.loads(Path(before).read_text())
        record["before"] = {"commit": earlier["provenance"]["commit"], "rows": earlier["rows"]}
    return bundle, three, settings, record
