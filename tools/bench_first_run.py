"""The README's first command as a new user runs it: `lantern generate --classes 0 .. 9` in a process of its own,
on an empty lantern cache (a new machine), at the bundle's sampling and at LlamaGen's class-to-image sampling
(tools/samplings.py), with `--method auto` (the default) against `--method ar`; then auto a few times more on the
same cache, as later requests learn (lantern.plan.deciding). Reports each process's whole wall time (start, model
load, deciding, decoding, writing images), its decode wall and what auto chose and spent deciding. Writes
results/first-run-cpu.{json,md}, naming the CPU, commit and command. Timing wants a quiet machine.

    python tools/bench_first_run.py [--sampling bundle llamagen-c2i] [--later 3] [--classes 0 1 ... 9]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastest_ar import provenance
from results_io import utc_now, write_results
from samplings import NAMES as SAMPLING_NAMES, LLAMAGEN_C2I

ROOT = Path(__file__).resolve().parents[1]
FLAGS = {"bundle": [], "llamagen-c2i": ["--top-k", str(LLAMAGEN_C2I["top_k"]),
                                        "--cfg-scale", str(LLAMAGEN_C2I["cfg_scale"])]}


def one_command(args: list[str], cache: Path) -> dict:
    """One `lantern generate ... --json` process on `cache`: its wall time and what its JSON says."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "LANTERN_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "lantern", "generate", *args, "--out", out, "--json"],
                             capture_output=True, text=True, env=env, cwd=out)
        wall = time.perf_counter() - start
    if run.returncode != 0:
        raise RuntimeError(f"lantern generate {' '.join(args)} exited {run.returncode}: {run.stderr[-2000:]}")
    out = json.loads(run.stdout)
    plan = out.get("plan") or {}
    return {"args": args, "process_s": wall, "decode_s": out["wall_seconds"],
            "chose": plan.get("plan", out.get("method")), "mode": plan.get("mode"),
            "deciding_s": plan.get("calibration_seconds", 0.0) + plan.get("calibration_prepare_seconds", 0.0),
            "deciding": plan.get("deciding")}


def setting(name: str, classes: list[int], later: int) -> dict:
    base = ["--classes", *map(str, classes), *FLAGS[name]]
    with tempfile.TemporaryDirectory() as fresh_ar, tempfile.TemporaryDirectory() as fresh:
        ar = one_command([*base, "--method", "ar"], Path(fresh_ar))
        runs = [one_command(base, Path(fresh)) for _ in range(1 + later)]  # the first on an empty cache
    return {"sampling": name, "ar": ar, "auto": runs}


def markdown(rec: dict) -> str:
    lines = [f"The README's first command, `lantern generate --classes {' '.join(map(str, rec['classes']))}`, each a "
             f"process of its own on an empty lantern cache; {rec['cpu']}, {rec['date']}. Process: the whole "
             "command's wall time (start, load, deciding, decoding, images written); decode: its generation alone; "
             "deciding: what auto spent measuring (acceptance records, timing, preparing runners). Auto's later "
             "requests reuse the first one's cache.", "",
             "| sampling | run | process (s) | x `--method ar`'s process | decode (s) | deciding (s) | chose |",
             "|---|---|---|---|---|---|---|"]
    for row in rec["rows"]:
        ar = row["ar"]
        lines.append(f"| {row['sampling']} | `--method ar` | {ar['process_s']:.1f} | 1.00 | {ar['decode_s']:.2f} | - "
                     f"| AR |")
        for i, run in enumerate(row["auto"]):
            label = "auto, first" if i == 0 else f"auto, request {i + 1}"
            lines.append(f"| {row['sampling']} | {label} | {run['process_s']:.1f} | "
                         f"{ar['process_s'] / run['process_s']:.2f} | {run['decode_s']:.2f} | "
                         f"{run['deciding_s']:.1f} | {run['chose']} ({run['mode'] or 'pinned'}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sampling", nargs="+", default=list(SAMPLING_NAMES), choices=SAMPLING_NAMES)
    ap.add_argument("--classes", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--later", type=int, default=3, help="auto's requests after the first, on the same cache")
    ap.add_argument("--out", default=str(ROOT / "results" / "first-run-cpu"))
    args = ap.parse_args()
    if args.later < 0:
        ap.error(f"--later {args.later} must be >= 0")
    rows = [setting(name, args.classes, args.later) for name in args.sampling]
    write_results(args.out, {"date": utc_now(), **provenance(), "classes": args.classes, "rows": rows}, markdown)


if __name__ == "__main__":
    main()
