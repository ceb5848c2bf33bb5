"""What crosses from the device to the host per speculative step, before and after the device-resident step.

Structural, not a timing (any machine state will do): a whole LANTERN++ generation of the embedded model for
10 images (one call; the previous revision decodes them one at a time), every host transfer counted by
tests/host_transfers.py, divided by the verify steps. "before" runs the previous revision in its own
environment (`--before-python`: a venv with the old revision installed, e.g. `git worktree add /tmp/before REV &&
python3 -m venv /tmp/before/.venv && /tmp/before/.venv/bin/pip install torch==2.13.0 -e /tmp/before`) with the same
counter loaded from this checkout.
Writes results/host-transfers.{json,md}.

    python tools/bench_host_transfers.py --before-python /tmp/before/.venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
COUNTER = ROOT / "tests" / "host_transfers.py"
BUNDLE = ROOT / "lantern" / "assets" / "default"  # both revisions decode this checkout's model

MEASURE = r"""
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("host_transfers", sys.argv[1])
ht = importlib.util.module_from_spec(spec); spec.loader.exec_module(ht)
from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding import SamplingConfig, method_preset
torch.set_num_threads(1)
bundle = load_bundle(sys.argv[2])
pipe = Pipeline(bundle.target, bundle.drafter, bundle.proximity, backend="cpu")
dcfg = method_preset("lantern++", SamplingConfig(**bundle.default_sampling))
classes = list(range(10))
pipe.generate(classes[:1], dcfg, seed=0)  # prepare and warm up outside the count
counter = ht.HostTransfers()
with counter:
    res = pipe.generate(classes, dcfg, seed=0)
steps = res.profile["phases"]["verify"]["count"]  # verify calls: one per batched step (per image step before)
print(json.dumps({"calls": counter.calls, "elements": counter.elements, "verify_steps": steps,
                  "images": len(classes), "vocab": bundle.target.config.vocab_size}))
"""


def run(python: str) -> dict:
    res = subprocess.run([python, "-P", "-c", MEASURE, str(COUNTER), str(BUNDLE)], capture_output=True, text=True,
                         check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before-python", help="python of an environment with the previous revision installed")
    ap.add_argument("--out", default=str(ROOT / "results" / "host-transfers"))
    args = ap.parse_args()
    rows = {"after": run(sys.executable)}
    if args.before_python:
        rows["before"] = run(args.before_python)
    write_results(args.out, {"date": utc_now(), "rows": rows}, markdown)


def markdown(rec: dict) -> str:
    lines = ["LANTERN++ (57-node tree) on the embedded model, 10 images, one generation; host transfers counted by "
             f"tests/host_transfers.py; {rec['date']}.", "",
             "| code | verify calls | host transfers | per verify call | elements moved | per verify call |",
             "|---|---|---|---|---|---|"]
    for name, r in rec["rows"].items():
        lines.append(f"| {name} | {r['verify_steps']} | {r['calls']} | {r['calls'] / r['verify_steps']:.1f} | "
                     f"{r['elements']} | {r['elements'] / r['verify_steps']:.0f} |")
    lines += ["", "Before, each verify call served one image; after, one call serves all 10 images. The totals include "
              "the one transfer of tokens and statistics at the end of a generation."]
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
