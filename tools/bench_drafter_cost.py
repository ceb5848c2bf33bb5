"""What one drafter call costs against one target step, on the embedded model, side by side in one run.

A single image with CFG (2 rows), torch eager: the target's AR step (verify width 1) and the drafter's step at
width 1 and at the widest drafting width of the default tree, each the median over `--repeats` calls on
prepared, warmed-up runners (lantern.profile.measure). Writes results/drafter-cost-<backend>-<dtype>.{json,md}.

    python tools/bench_drafter_cost.py [--backend cpu] [--dtype fp32]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lantern.backends import get_backend
from lantern.bundle import load_bundle
from lantern.decoding import SamplingConfig, method_preset
from lantern.profile.measure import draft_latency, step_spec, verify_latency
from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bundle = load_bundle()
    backend = get_backend(args.backend)
    cfg = bundle.target.config
    width = method_preset("lantern++", SamplingConfig()).strategy.level_width
    rows = 2  # one image, [cond; uncond]
    target = verify_latency(backend, bundle.target, step_spec(cfg, rows, args.dtype, 1), 20, args.repeats)
    drafts = {w: draft_latency(backend, bundle.target, bundle.drafter, step_spec(cfg, rows, args.dtype, 1, w), 20,
                               args.repeats) for w in sorted({1, width})}
    t = target["latency"]["median_s"]
    record = {"date": utc_now(), "backend": args.backend, "dtype": args.dtype, "threads": args.threads,
              "target_layers": cfg.n_layer, "dim": cfg.dim, "target_step_s": t,
              "drafter": {str(w): {"median_s": d["latency"]["median_s"], "ratio": d["latency"]["median_s"] / t}
                          for w, d in drafts.items()}}
    write_results(ROOT / "results" / f"drafter-cost-{args.backend}-{args.dtype}", record, markdown)


def markdown(rec: dict) -> str:
    lines = [f"Embedded target ({rec['target_layers']} layers x {rec['dim']}), `{rec['backend']}` {rec['dtype']}, "
             f"{rec['threads']} threads, one image with CFG (2 rows); medians; {rec['date']}.", "",
             "| step | ms | / target step |", "|---|---|---|",
             f"| target step (AR, width 1) | {1e3 * rec['target_step_s']:.2f} | 1.00 |"]
    lines += [f"| drafter call, width {w} | {1e3 * d['median_s']:.2f} | {d['ratio']:.3f} |"
              for w, d in rec["drafter"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
