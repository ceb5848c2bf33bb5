"""Every method's wall time and true memory peak at a narrow and at the whole support, side by side.

Each (method, top-k) runs `lantern generate --json` in a fresh process (16 images decoded together by default, the
embedded model, eager fp32 unless told otherwise), so each run's peak is its own: the child's resident high-water
mark as the kernel reports it when the child exits (os.wait4's ru_maxrss), next to the peak the JSON reports.
Reported per method: decode wall time, peak RSS, tokens per target forward and the mean token TV at each top-k,
and the ratio of the wide run to the narrow one (the issue's bar: within 1.5x for both time and memory). Relaxed
methods run with the rule given on the command line (`--rule`), so the rows say exactly what was measured.
Writes results/support-<backend>.{json,md}, naming the CPU, commit and command. Timing wants a quiet machine.

    python tools/bench_support.py [--methods ar mc-sjd ...] [--top-k 5 1024] [--images 16] [--seed 0]
                                  [--backend cpu] [--dtype fp32] [--rule mc-sjd-relaxed:acceptance=lantern,k=32,delta=0.2]
                                  [--quick]

--quick checks that the tool runs (2 images, ar and mc-sjd, a temporary output); its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lantern.decoding.config import METHODS
from fastest_ar import provenance
from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
FLAGS = {"acceptance": "--acceptance", "k": "--k", "delta": "--delta", "lam": "--lam", "form": "--relaxation",
         "window": "--window", "drafting": "--drafting"}


def parse_rule(spec: str) -> tuple[str, list[str]]:
    """'METHOD:key=value,...' -> (method, generate's override flags)."""
    method, _, body = spec.partition(":")
    if method not in METHODS:
        raise SystemExit(f"--rule {spec!r}: unknown method {method!r}; allowed: {', '.join(METHODS)}")
    flags = []
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if key not in FLAGS or not value:
            raise SystemExit(f"--rule {spec!r}: {item!r} is not KEY=VALUE with KEY one of {', '.join(FLAGS)}")
        flags += [FLAGS[key], value]
    return method, flags


def run_one(method: str, flags: list[str], top_k: int, args) -> dict:
    """One fresh `lantern generate` process: its JSON, and the kernel's record of its peak RSS."""
    classes = [str(i % 10) for i in range(args.images)]
    cmd = [sys.executable, "-m", "lantern.cli", "generate", "--classes", *classes, "--method", method, *flags,
           "--batch", str(args.images), "--seed", str(args.seed), "--top-k", str(top_k), "--backend", args.backend,
           "--dtype", args.dtype, "--json", "--no-images"]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        text, errors = out.read().decode(), err.read().decode()
    if child.returncode != 0:
        return {"error": f"exit {child.returncode}: {errors.strip().splitlines()[-1] if errors.strip() else ''}"}
    record = json.loads(text)
    stats = record["stats"]
    return {"wall_s": record["wall_seconds"], "peak_rss_bytes": usage.ru_maxrss * 1024,
            "reported_peak_bytes": record["peak_memory_bytes"], "tokens_per_forward": record["step_compression"],
            "mean_token_tv": stats.get("token_tv_mean", 0.0), "decode": record["decode"]}


def markdown(record: dict) -> str:
    narrow, wide = (str(k) for k in record["top_k"])
    p = record["machine"]
    lines = [f"# Every method at top-k {narrow} and {wide} ({record['images']} images decoded together, "
             f"{record['backend']} {record['dtype']})", "",
             f"{p['cpu']}; commit {p['commit']}; {record['when']}. Each run is a fresh process; peak RSS is the "
             "kernel's high-water mark of that process (os.wait4).", "",
             f"Command: `{p['command']}`", "",
             f"| method | wall top-k {narrow} | wall top-k {wide} | x | peak RSS {narrow} | peak RSS {wide} | x | "
             f"tokens/forward {narrow} / {wide} | mean token TV {narrow} / {wide} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, runs in record["rows"].items():
        a, b = runs[narrow], runs[wide]
        if "error" in a or "error" in b:
            lines.append(f"| {label} | {a.get('error', '')} | {b.get('error', '')} | | | | | | |")
            continue
        lines.append(
            f"| {label} | {a['wall_s']:.1f} s | {b['wall_s']:.1f} s | {b['wall_s'] / a['wall_s']:.2f} | "
            f"{a['peak_rss_bytes'] / 1e9:.2f} GB | {b['peak_rss_bytes'] / 1e9:.2f} GB | "
            f"{b['peak_rss_bytes'] / a['peak_rss_bytes']:.2f} | {a['tokens_per_forward']:.2f} / "
            f"{b['tokens_per_forward']:.2f} | {a['mean_token_tv']:.3f} / {b['mean_token_tv']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=["ar", "sjd", "mc-sjd", "eagle2", "lantern", "lantern++",
                                                     "mc-sjd-relaxed"], choices=METHODS)
    ap.add_argument("--rule", action="append", default=[], metavar="METHOD:KEY=VALUE,...",
                    help="a method's overrides, e.g. 'mc-sjd-relaxed:acceptance=lantern,k=32,delta=0.2'")
    ap.add_argument("--top-k", type=int, nargs=2, default=[5, 1024], metavar=("NARROW", "WIDE"))
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--out", help="output stem (default results/support-<backend>)")
    ap.add_argument("--quick", action="store_true", help="a check that the tool runs; its numbers mean nothing")
    args = ap.parse_args()
    if args.quick:
        args.methods, args.images = ["ar", "mc-sjd"], 2
        args.out = args.out or str(Path(tempfile.mkdtemp(prefix="lantern-support-quick-")) / "support")
    rules = dict(parse_rule(spec) for spec in args.rule)
    rows = {}
    for method in args.methods:
        flags = rules.get(method, [])
        label = method + (f" ({' '.join(flags)})" if flags else "")
        rows[label] = {}
        for top_k in args.top_k:
            print(f"{label} top-k {top_k} ...", file=sys.stderr, flush=True)
            rows[label][str(top_k)] = run_one(method, flags, top_k, args)
    record = {"top_k": args.top_k, "images": args.images, "backend": args.backend, "dtype": args.dtype,
              "seed": args.seed, "when": utc_now(), "machine": provenance(), "rows": rows}
    write_results(args.out or ROOT / f"results/support-{args.backend}", record, markdown)


if __name__ == "__main__":
    main()
