"""Issue 59's scenario: on a fresh lantern cache (and a fresh inductor cache: a new machine), one
`lantern generate --method ar --backend cpu-graph` (compiled AR), then --runs default `lantern generate` requests,
then the compiled AR again, each a process of its own. Reports each process's wall time, its decode wall, what it
spent preparing runners and what auto chose; each default request is compared with the compiled AR by decode wall
and, against the compiled AR run again (its compile on disk: a re-trace), by process time (from the second request
on, auto should be at least as fast as that AR). Writes results/second-request-cpu.{json,md},
naming the CPU (lscpu), commit and command. Timing wants a quiet machine.

    python tools/second_request.py [--runs 5] [--classes 7] [--seed 0]
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

ROOT = Path(__file__).resolve().parents[1]


def lscpu_model() -> str:
    """The CPU's model name as lscpu gives it ('' where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


def generate(flags: list[str], cache: Path) -> dict:
    """One `lantern generate ... --no-images --json` process on `cache`: its wall time and what its JSON says."""
    env = {**os.environ, "LANTERN_CACHE_DIR": str(cache / "lantern"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "PYTHONPATH": str(ROOT)}
    env.pop("LANTERN_BACKEND", None)  # the default requests name no backend
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "lantern", "generate", *flags, "--no-images", "--json"],
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise RuntimeError(f"lantern generate {' '.join(flags)} exited {run.returncode}: {run.stderr[-2000:]}")
    out = json.loads(run.stdout)
    plan = out.get("plan") or {}
    return {"flags": flags, "process_s": wall, "decode_s": out["wall_seconds"], "prepare_s": out["warmup_seconds"],
            "chose": f"{plan.get('plan', out['mode'])} on {out['backend']} ({plan.get('mode', 'named')})",
            "predicted_s": plan.get("predicted_seconds"), "line": next(
                (x for x in run.stderr.splitlines() if x.startswith("lantern: auto chose")), "")}


def markdown(rec: dict) -> str:
    ar, again = rec["runs"][0], rec["runs"][-1]
    lines = [f"Issue 59's scenario, each a process of its own on a fresh lantern and inductor cache: `lantern generate "
             f"{' '.join(ar['flags'])}`, then {len(rec['runs']) - 2} default request(s) and the compiled AR again; "
             f"{rec['lscpu'] or rec['cpu']}, {rec['date']}. "
             "Process: the whole command's wall time; decode: its generation alone; preparing: its runner's "
             "preparation and warm-up (a compile or its re-trace); x compiled AR: the first compiled AR's decode wall "
             "over this one's, and the compiled AR run again (its compile on disk, the last row)'s process time over "
             "this one's.", "",
             "| request | chose | process (s) | decode (s) | preparing (s) | x compiled AR (decode) | "
             "x compiled AR again (process) |", "|---|---|---|---|---|---|---|"]
    for i, run in enumerate(rec["runs"]):
        label = ("compiled AR" if i == 0 else "compiled AR again" if i == len(rec["runs"]) - 1 else f"default {i}")
        lines.append(f"| {label} | {run['chose']} | {run['process_s']:.1f} | {run['decode_s']:.2f} | "
                     f"{run['prepare_s']:.1f} | {ar['decode_s'] / run['decode_s']:.2f} | "
                     f"{again['process_s'] / run['process_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="default requests after the compiled AR")
    ap.add_argument("--classes", type=int, nargs="+", default=[7])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "results" / "second-request-cpu"))
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs {args.runs} must be >= 1")
    base = ["--classes", *map(str, args.classes), "--seed", str(args.seed)]
    with tempfile.TemporaryDirectory() as fresh:
        named = [*base, "--method", "ar", "--backend", "cpu-graph"]
        runs = [generate(named, Path(fresh))]
        runs += [generate(base, Path(fresh)) for _ in range(args.runs)]
        runs.append(generate(named, Path(fresh)))  # the compiled AR again: its compile on disk, as a user reruns it
    write_results(args.out, {"date": utc_now(), **provenance(), "lscpu": lscpu_model(), "classes": args.classes,
                             "seed": args.seed, "runs": runs}, markdown)


if __name__ == "__main__":
    main()
