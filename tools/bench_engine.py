"""Static chunks against continuous batching: a stream of mixed requests (random classes, one method at a time)
through the step engine at several batch widths; images/s and per-image latency.

Static chunks: `width` requests at a time, each chunk running until its slowest image is done (what a
batch-at-a-time loop does). With --temperatures, each request draws its own temperature from the list (a
per-request setting the engine's static shape allows), so images of one stream finish after more different
numbers of steps. Continuous: the whole stream queued at once, a slot taking the next request as
soon as its image finishes. Both see the stream at t = 0, so latency = finish - stream start; the same
requests (classes, seeds) and the same warmed-up runner in both. Every step of a width costs the same (static
shapes), so the ratio of the two modes' step counts is the speed-up continuous batching can reach on this stream:
the table reports it next to the measured one, and the ceiling for an endless stream of such requests: the
expected slowest of `width` images (drawn from this stream's per-image step counts) over the mean image. Prints a markdown table (and --json).

    python tools/bench_engine.py [--model BUNDLE] [--backend cpu] [--methods ar lantern++ mc-sjd]
                                 [--widths 4 16] [--images 64] [--temperatures 0.5 1.0]
    python tools/bench_engine.py --out results/engine-cpu   # writes the results file
    python tools/bench_engine.py --quick      # a tiny random model: checks the tool runs, numbers mean nothing
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch
from tqdm import tqdm

from lantern.api import Pipeline
from lantern.decoding import SamplingConfig, method_preset
from lantern.engine import Engine, Request
from lantern.engine.slot_sampling import SamplingOverrides
from results_io import write_results


def tiny_pipeline(backend: str) -> tuple[Pipeline, SamplingConfig]:
    """Random GPT-test models (no download): for --quick."""
    from lantern.models.config import gpt_preset
    from lantern.models.drafter import Drafter
    from lantern.models.gpt import GPT
    from lantern.models.proximity import build_proximity_table
    torch.manual_seed(0)
    cfg = gpt_preset("GPT-test")
    target = GPT(cfg).eval()
    with torch.no_grad():
        target.output.weight.mul_(8.0)
    codebook = torch.nn.functional.normalize(torch.randn(cfg.vocab_size, 8), dim=1)
    proximity = build_proximity_table(codebook, cfg.vocab_size - 1)
    return Pipeline(target, Drafter(cfg).eval(), proximity, backend=backend), SamplingConfig(cfg_scale=2.0, top_k=20)


QUICK_OVERRIDES = {"mc-sjd": dict(window=4), "sjd": dict(window=4), "mc-sjd-relaxed": dict(window=4),
                   "eagle2": dict(dynamic_depth=3, dynamic_total=10), "lantern": dict(dynamic_depth=3, dynamic_total=10)}


def stream(engine: Engine, requests: list[Request], chunk: int | None) -> dict:
    """Run the requests (all arriving at t0) in chunks of `chunk` (None: continuously) -> figures."""
    t0 = time.perf_counter()
    results = []
    groups = [requests] if chunk is None else [requests[i:i + chunk] for i in range(0, len(requests), chunk)]
    for group in groups:
        for r in group:
            engine.submit(r)
        results += engine.run()
    wall = time.perf_counter() - t0
    latency = sorted(r.finished_s - t0 for r in results)
    return {"image_steps": [r.stats.images[0].target_forwards for r in results],"images": len(results), "wall_s": wall, "images_per_s": len(results) / wall,
            "latency_mean_s": statistics.fmean(latency), "latency_p50_s": latency[len(latency) // 2],
            "latency_p90_s": latency[min(len(latency) - 1, int(0.9 * len(latency)))],
            "steps": engine.steps_run}


def endless_stream_ceiling(image_steps: list[int], width: int) -> float:
    """E[max of `width` images' steps] / E[steps], images drawn from `image_steps`: static chunks of an endless
    stream take the slowest image's steps per chunk, continuous batching the mean image's."""
    xs, n = sorted(image_steps), len(image_steps)
    slowest = sum(x * (((i + 1) / n) ** width - (i / n) ** width) for i, x in enumerate(xs))
    return slowest / (sum(xs) / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="bundle folder (default: the embedded model)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype")
    ap.add_argument("--methods", nargs="+", default=["ar", "lantern++", "mc-sjd"])
    ap.add_argument("--widths", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--images", type=int, default=64, help="requests in the stream")
    ap.add_argument("--seed", type=int, default=0, help="classes and request seeds of the stream")
    ap.add_argument("--temperatures", type=float, nargs="+",
                    help="each request's temperature drawn from these (default: the bundle's, for all)")
    ap.add_argument("--quick", action="store_true", help="a tiny random model, 8 images: checks the tool runs")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument("--out", help="results stem: writes <stem>.json and <stem>.md (e.g. results/engine-cpu)")
    args = ap.parse_args()
    if args.quick:
        pipe, sampling = tiny_pipeline(args.backend)
        args.images = min(args.images, 8)
    else:
        from lantern.bundle import load_bundle
        bundle = load_bundle(args.model)
        pipe = Pipeline.from_bundle(bundle, backend=args.backend, dtype=args.dtype)
        sampling = SamplingConfig(**bundle.default_sampling)
    rng = random.Random(args.seed)
    def overrides():
        return SamplingOverrides(temperature=rng.choice(args.temperatures)) if args.temperatures else None
    requests = [Request(rng.randrange(pipe.config.num_classes), seed=rng.randrange(2 ** 62), request_id=str(i),
                        sampling=overrides()) for i in range(args.images)]
    rows = []
    jobs = [(m, w) for m in args.methods for w in args.widths]
    for method, width in tqdm(jobs, desc="runs", file=sys.stderr):
        dcfg = method_preset(method, sampling, **(QUICK_OVERRIDES.get(method, {}) if args.quick else {}))
        engine = Engine(pipe, dcfg, width)  # prepares and warms up the runner before anything is timed
        static = stream(engine, requests, width)
        engine = Engine(pipe, dcfg, width)
        continuous = stream(engine, requests, None)
        rows.append({"method": method, "width": width, "static": static, "continuous": continuous,
                     "speedup": continuous["images_per_s"] / static["images_per_s"],
                     "step_ratio": static["steps"] / continuous["steps"],
                     "ceiling": endless_stream_ceiling(continuous["image_steps"], width)})
    record = {"backend": pipe.backend.name, "dtype": pipe.dtype, "images": args.images, "quick": args.quick,
              "temperatures": args.temperatures or [sampling.temperature],
              "torch_threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        print(json.dumps(record, indent=1))
        return
    if args.out:
        write_results(args.out, record, markdown)
    else:
        print(markdown(record))


def markdown(record: dict) -> str:
    lines = [f"Static chunks against continuous batching ({record['backend']} {record['dtype']}, a stream of "
             f"{record['images']} requests with random classes and seeds, temperature "
             f"{' / '.join(map(str, record.get('temperatures', ['the bundle default'])))} (drawn per request), "
             f"{record['torch_threads']} torch thread(s); latency from the stream's start). Step ratio: static steps / "
             f"continuous steps, the speed-up continuous batching reaches at equal step cost; ceiling: the same for an "
             f"endless stream of such requests (expected slowest of `width` images / mean image, in steps).", "",
             "| method | width | static images/s | continuous images/s | speed-up | step ratio | ceiling | static "
             "latency mean / p90 s | continuous latency mean / p90 s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        s, c = r["static"], r["continuous"]
        lines.append(f"| {r['method']} | {r['width']} | {s['images_per_s']:.3f} | {c['images_per_s']:.3f} | "
                     f"{r['speedup']:.2f}x | {_ratio(r)} | {_ceiling(r)} | {s['latency_mean_s']:.2f} / {s['latency_p90_s']:.2f} | "
                     f"{c['latency_mean_s']:.2f} / {c['latency_p90_s']:.2f} |")
    prov = record.get("provenance")
    if prov:
        lines += ["", f"Machine: {prov['machine']}; commit {prov['commit']}; command `{prov['command']}`."]
    return "\n".join(lines) + "\n"


def _ratio(row: dict) -> str:
    ratio = row.get("step_ratio", row["static"]["steps"] / row["continuous"]["steps"])
    return f"{ratio:.2f}x"


def _ceiling(row: dict) -> str:
    return f"{row['ceiling']:.2f}x" if "ceiling" in row else "-"


if __name__ == "__main__":
    main()
