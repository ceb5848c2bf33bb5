"""Aten ops per decode step of the eager step, counted as they are dispatched (tests/step_ops.py): a count,
not a timing.

On a GPU the eager step (what `cuda` runs until a graph is ready) launches a kernel for nearly every op it
dispatches, views aside, a few microseconds each however small the tensor; so what a step dispatches beyond the
target's forward is what it pays on every step for being eager. Per method preset, one image on the `cpu` backend
(the eager torch code a GPU runs too), a steady step (after the one that prefills): every op, and how they split over
the target's forward, the drafter's forwards, the counter hash of the random streams, proposal, distributions,
acceptance, commit and the rest (tests/step_ops.py names each). The embedded bundle (or `--shape`: it inflated
to LlamaGen's compute shapes), at the bundle's sampling and LlamaGen's class-to-image one (tools/samplings.py), each
relaxed method at the settings the bundle validated at that sampling. `--before FILE` puts an earlier record's counts
beside these (the same rows, matched by method and sampling). tests/profile/test_step_ops.py holds each method's
budget beyond the forward. Writes results/step-ops-cpu. Any load on the machine is fine: nothing is timed.

    python tools/bench_step_ops.py [--methods ar mc-sjd ...] [--sampling bundle llamagen-c2i] [--dtype bf16]
                                   [--shape GPT-B] [--before results/step-ops-cpu.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lantern.api import Pipeline
from lantern.decoding import method_preset
from lantern.decoding.config import METHODS
from lantern.models.inflate import INFLATE_SHAPES
from embedded_shapes import count_record
from results_io import write_results
from samplings import NAMES as SAMPLING_NAMES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the op counter, the step-op budget test's instrument
from step_ops import REGIONS, step_ops  # noqa: E402


def row(pipe: Pipeline, method: str, sampling_name: str, dcfg, steps: int) -> dict:
    counted = step_ops(pipe, dcfg, steps)
    pipe.release()
    if len({c.total for c in counted}) != 1:  # every step of a static shape dispatches the same ops
        raise RuntimeError(f"{method}: the counted steps differ: {[c.to_dict() for c in counted]}")
    return {"method": method, "sampling": sampling_name, "verify_width": dcfg.verify_width, "decode": dcfg.to_dict(),
            **counted[0].to_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--sampling", nargs="+", default=list(SAMPLING_NAMES), choices=SAMPLING_NAMES)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--shape", default="embedded", choices=["embedded", *sorted(INFLATE_SHAPES)],
                    help="the embedded model, or it inflated to a LlamaGen compute shape")
    ap.add_argument("--steps", type=int, default=2, help="steady steps counted per method (they must agree)")
    ap.add_argument("--before", help="an earlier record of this tool, shown beside this one")
    ap.add_argument("--out", help="output stem (default results/step-ops-cpu)")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps {args.steps} must be >= 1")
    bundle, (target, drafter, proximity), settings, record = count_record(args.shape, args.dtype, args.sampling,
                                                                          args.before)
    pipe = Pipeline(target, drafter, proximity, backend="cpu", dtype=args.dtype)
    for name, sampling in settings.items():
        relaxation = bundle.relaxation_at(sampling)
        for method in args.methods:
            dcfg = method_preset(method, sampling, **relaxation.get(method, {}))
            record["rows"].append(row(pipe, method, name, dcfg, args.steps))
            write_results(args.out or ROOT / "results" / "step-ops-cpu", record, markdown)  # after every row


def markdown(rec: dict) -> str:
    before = {(r["method"], r["sampling"]): r for r in rec.get("before", {}).get("rows", [])}
    lines = [f"Aten ops per decode step of the eager step (backend `cpu`), counted as dispatched (torch "
             f"{rec['torch']}): the {rec['shape']} model, {rec['dtype']}, one image, a steady step. Samplings: "
             + "; ".join(f"{n}: {d}" for n, d in rec["samplings"].items()) + ". Beyond: the step's ops less the "
             "target's forward; views: those of them that return a view of an input (no kernel). The regions split "
             "what is beyond the forward (tests/step_ops.py)."]
    if before:
        lines[0] += f" Before: commit {rec['before']['commit']}; after: this record's (x -> y where they differ)."
    lines += ["", "| sampling | method | verify width | step | forward | beyond | beyond: views | "
                  + " | ".join(REGIONS[1:]) + " |", "|---|---|---|---|---|---|---|" + "---|" * len(REGIONS[1:])]

    def cell(r: dict, old: dict | None, get) -> str:
        new = get(r)
        return str(new) if old is None or get(old) == new else f"{get(old)} -> {new}"
    for r in rec["rows"]:
        old = before.get((r["method"], r["sampling"]))
        cells = [cell(r, old, lambda x: x["total"]), cell(r, old, lambda x: x["forward"]),
                 cell(r, old, lambda x: x["beyond_forward"]), cell(r, old, lambda x: x["beyond_forward_views"])]
        cells += [cell(r, old, lambda x, name=name: x["regions"][name]) for name in REGIONS[1:]]
        lines.append(f"| {r['sampling']} | {r['method']} | {r['verify_width']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
