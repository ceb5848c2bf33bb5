"""Measure the embedded bundle's acceptance record for a dtype (steps per image of every `--method auto` plan,
the relaxations the bundle validated at its default sampling included, at that sampling) and store it in the bundle's manifest
("acceptance_records", by dtype), so that `lantern generate` on a fresh machine only calibrates latencies. Any
backend gives the same record up to numerics, so it is measured on cpu in the dtype. Only plans the record
lacks, or holds for other decode settings, are measured (all of them when `--per-class` changes the images);
entries of plans that are no longer candidates are dropped.

    python tools/record_acceptance.py [--dtype fp32|bf16] [--per-class 10] [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from lantern.files import atomic_io
from lantern.api import Pipeline
from lantern.bundle import DEFAULT_BUNDLE, load_bundle
from lantern.decoding.sampling import SamplingConfig
from lantern.plan import acceptance_records as records
from lantern.plan.candidates import candidate_plans
from lantern.plan.choose import allowed_relaxation, runnable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-class", type=int, default=10, help="images per class")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the numerics the record is for")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="print the record, do not write the manifest")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bundle = load_bundle()
    pipe = Pipeline(bundle.target, bundle.drafter, bundle.proximity, backend="cpu", dtype=args.dtype)
    sampling = SamplingConfig(**bundle.default_sampling)
    # the relaxed plans auto runs without --allow-relaxed: those the bundle validated at this sampling
    relaxation, _ = allowed_relaxation(False, bundle.validations, sampling, bundle.target.config.vocab_size)
    classes = [c for c in range(bundle.target.config.num_classes) for _ in range(args.per_class)]
    plans, _ = runnable(pipe, candidate_plans(True, True, relaxation), sampling, len(classes))
    key, shipped = pipe.model_key, bundle.acceptance_records.get(args.dtype)
    # entries measured on other images would mix two samples: a new image set starts afresh
    same = records.matches(shipped, key, sampling) and shipped.get("conditions") == classes
    record = shipped if same else records.empty_record(key, sampling, args.dtype)
    t0 = time.perf_counter()
    records.measure_record(lambda p: pipe.generate(classes, p.decode(sampling), seed=0, batch=len(classes)), plans,
                           record, classes)
    record["plans"] = {p.name: record["plans"][p.name] for p in plans if p.name in record["plans"]}  # current only
    record.update(conditions=classes, seed=0, backend="cpu", dtype=args.dtype,
                  seconds=record.get("seconds", 0.0) + time.perf_counter() - t0)
    for name, entry in record["plans"].items():
        print(f"{name:<24} steps/image {sum(entry['steps']) / len(entry['steps']):6.1f}  max {max(entry['steps'])}"
              f"  tau {entry['tau']:.2f}")
    if not args.dry_run:
        path = DEFAULT_BUNDLE / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest.setdefault("acceptance_records", {})[args.dtype] = record
        atomic_io.write_text(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        print(f"wrote acceptance_records[{args.dtype!r}] into {path}")


if __name__ == "__main__":
    main()
