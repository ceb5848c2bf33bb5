"""Batched speculation on the embedded model: AR vs chain-5 vs LANTERN++ for 1 and 10 images, batched and one
image at a time, and the previous revision's one-at-a-time decoding, side by side in one run (torch eager).

Every configuration is prepared and warmed up before anything is timed; each is then timed `--repeats` times
in rotating order and the median wall time (VQ decoding excluded) is reported. "before" runs the previous
revision's own Pipeline in its own environment (`--before-python`, see tools/bench_acceptance.py), on this
checkout's bundle (the same model).
Writes results/batched-<backend>-<dtype>.{json,md}.

    python tools/bench_batched.py --before-python /tmp/before/.venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding import SamplingConfig, method_preset
from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"ar": dict(method="ar"), "chain-5": dict(method="lantern++", drafting="chain-5", acceptance="exact"),
           "lantern++": dict(method="lantern++")}

# The previous revision: the same methods through its own Pipeline (speculation one image at a time there).
BEFORE = r"""
import json, statistics, sys, time, torch
from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding import SamplingConfig, method_preset
methods, images, repeats, backend, dtype, threads, bundle_path = json.loads(sys.argv[1])
torch.set_num_threads(threads)
bundle = load_bundle(bundle_path)
pipe = Pipeline(bundle.target, bundle.drafter, bundle.proximity, backend=backend, dtype=dtype)
sc = SamplingConfig(**bundle.default_sampling)
configs = {name: method_preset(kw.pop("method"), sc, **kw) for name, kw in methods.items()}
classes = {n: list(range(n)) for n in images}
for d in configs.values():
    for n in images:
        pipe.generate(classes[n][:1], d, seed=0)
out = {}
for name, d in configs.items():
    for n in images:
        walls = [pipe.generate(classes[n], d, seed=r).stats.wall_seconds for r in range(repeats)]
        out[f"{name}/{n}"] = statistics.median(walls)
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--images", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--before-python", help="python of an environment with the previous revision installed")
    ap.add_argument("--out", help="output stem (default results/batched-<backend>-<dtype>)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bundle = load_bundle()
    pipe = Pipeline(bundle.target, bundle.drafter, bundle.proximity, backend=args.backend, dtype=args.dtype)
    sc = SamplingConfig(**bundle.default_sampling)
    configs = {name: method_preset(kw["method"], sc, **{k: v for k, v in kw.items() if k != "method"})
               for name, kw in METHODS.items()}
    cases = [(name, n, width) for name in configs for n in args.images
             for width in ([n] if name == "ar" or n == 1 else [n, 1])]  # batched, and one image at a time
    for name, n, width in cases:  # prepare and warm up every static shape before timing anything
        pipe.generate([0] * min(n, width), configs[name], seed=0, batch=width)
    walls = {case: [] for case in cases}
    stats = {}
    for r in range(args.repeats):
        for case in cases[r % len(cases):] + cases[: r % len(cases)]:
            name, n, width = case
            res = pipe.generate(list(range(n)), configs[name], seed=r, batch=width)
            walls[case].append(res.stats.wall_seconds)
            stats[case] = res.stats.summary()
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    rows = [{"method": name, "images": n, "batch": width, "wall_s": statistics.median(walls[(name, n, width)]),
             "step_compression": stats[(name, n, width)]["step_compression"],
             "tau": stats[(name, n, width)]["mean_accepted_length"], "source": "this revision"}
            for name, n, width in cases]
    if args.before_python:
        methods = {name: dict(kw) for name, kw in METHODS.items()}
        res = subprocess.run([args.before_python, "-P", "-c", BEFORE,
                              json.dumps([methods, args.images, args.repeats, args.backend, args.dtype, args.threads,
                                          str(bundle.path)])],
                             capture_output=True, text=True, check=True)
        for key, wall in json.loads(res.stdout.strip().splitlines()[-1]).items():
            name, n = key.split("/")
            rows.append({"method": name, "images": int(n), "batch": int(n) if name == "ar" else 1, "wall_s": wall,
                         "step_compression": None, "tau": None, "source": "previous revision"})
    ar = {r["images"]: r["wall_s"] for r in rows if r["method"] == "ar" and r["source"] == "this revision"}
    for r in rows:
        r["vs_ar"] = r["wall_s"] / ar[r["images"]]
    record = {"date": utc_now(), "backend": args.backend, "dtype": args.dtype,
              "threads": args.threads, "machine": platform.processor(), "torch": torch.__version__,
              "repeats": args.repeats, "bundle": bundle.manifest.get("name"), "sampling": bundle.default_sampling,
              "rows": rows}
    write_results(args.out or ROOT / "results" / f"batched-{args.backend}-{args.dtype}", record, markdown)


def markdown(rec: dict) -> str:
    lines = [f"Embedded model, `{rec['backend']}` {rec['dtype']}, {rec['threads']} threads, {rec['machine']}, torch "
             f"{rec['torch']}; median of {rec['repeats']} runs, decode wall time (VQ decoding excluded); {rec['date']}.",
             "", "| method | images | images per step (B) | code | wall s | time / AR's (same images) | step compression "
             "| tau |", "|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        sc = f"{r['step_compression']:.2f}" if r["step_compression"] else "-"
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        lines.append(f"| {r['method']} | {r['images']} | {r['batch']} | {r['source']} | {r['wall_s']:.2f} | "
                     f"{r['vs_ar']:.2f}x | {sc} | {tau} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
