"""Eager CPU attention over the cache slots in use against attention over the whole preallocated cache, side by
side in one run, on the embedded model: whole single-image generations of AR and MC-SJD (L=16).

The same prepared runner runs both ways (`trims_attention` on and off), in alternating order per image, so drift
in machine load hits both alike; per method and dtype: the median seconds per image each way and the median of
the per-image ratios. Writes results/attention-trim-cpu.{json,md}. Timing wants a quiet machine.

    python tools/bench_attention_trim.py [--images 6] [--dtypes fp32 bf16] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding import SamplingConfig, method_preset
from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]


def measure(pipe: Pipeline, dcfg, images: int) -> dict:
    """Seconds per image with attention over the slots in use ("trimmed") and over the whole cache."""
    runner = pipe.runner(dcfg, 1)
    walls = {True: [], False: []}
    for i in tqdm(range(images), desc="images", leave=False):
        for trims in ((True, False) if i % 2 == 0 else (False, True)):
            runner.trims_attention = trims
            walls[trims].append(pipe.generate([i % pipe.config.num_classes], dcfg, seed=i).stats.wall_seconds)
    runner.trims_attention = True
    ratios = [whole / trimmed for trimmed, whole in zip(walls[True], walls[False])]
    return {"trimmed_s": statistics.median(walls[True]), "whole_cache_s": statistics.median(walls[False]),
            "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)],
            "walls": {"trimmed": walls[True], "whole_cache": walls[False]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=6, help="single images per method and dtype (class i % 10, seed i)")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "attention-trim-cpu"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bundle = load_bundle()
    sampling = SamplingConfig(**bundle.default_sampling)
    methods = {"AR": method_preset("ar", sampling), "MC-SJD L=16": method_preset("mc-sjd", sampling, window=16)}
    rows = []
    for dtype in args.dtypes:
        pipe = Pipeline(bundle.target, None, None, backend="cpu", dtype=dtype)
        for name, dcfg in methods.items():
            pipe.generate([0], dcfg, seed=0)  # warm this runner
            rows.append({"dtype": dtype, "method": name, **measure(pipe, dcfg, args.images)})
    record = {"date": utc_now(), "threads": args.threads, "images": args.images, "rows": rows}
    write_results(args.out, record, markdown)


def markdown(rec: dict) -> str:
    lines = [f"Embedded model, torch eager cpu, {rec['threads']} threads, {rec['images']} single images per row "
             f"(class i mod 10, seed i), both ways alternating per image; {rec['date']}.", "",
             "| dtype | method | s / image, slots in use | s / image, whole cache | speed-up, median of per-image "
             "ratios [range] |", "|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['method']} | {r['trimmed_s']:.3f} | {r['whole_cache_s']:.3f} | "
              f"{r['speedup']:.3f} [{r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f}] |" for r in rec["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
