"""The acceptance phase at LlamaGen scale, before (host-side walk, one image at a time) and after (one tensor
program for B images), side by side in one run.

Phase = what happens between a verify's logits and the accepted path: CFG, temperature/top-k warping, every
candidate's acceptance, the draws, the path and the bonus token. Inputs are random logits of LlamaGen's shape:
V = 16384 codes, the 57-node LANTERN++ tree (N = 58 with the root), top-k 1000, CFG 4.0, B = 1 and 8 images.
"Before" runs the previous revision's own code (its `walk_tree`, `combine_cfg`, `warp`) in that revision's
environment (`--before-python`, a venv with the old revision installed); "after" runs this checkout's.
Writes results/acceptance-phase-cpu.{json,md}.

    git worktree add /tmp/before fe25dc9 && python3 -m venv /tmp/before/.venv && \\
      /tmp/before/.venv/bin/pip install torch==2.13.0 -e /tmp/before
    python tools/bench_acceptance.py --before-python /tmp/before/.venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
V, TOP_K, CFG, TREE = 16384, 1000, 4.0, "lantern++-57"

# The previous revision's acceptance phase, per image, as its decode loop ran it (copy to host, CFG + warp on
# the host, the Python tree walk). Runs in the old environment; prints the median seconds per step as JSON.
BEFORE = r"""
import json, statistics, sys, time, torch
from lantern.decoding.acceptance import Acceptance, walk_tree
from lantern.decoding.sampling import SamplingConfig, combine_cfg, warp
from lantern.decoding.trees import TREE_PRESETS, compile_tree
b, reps, V, top_k, cfg, tree_name = json.loads(sys.argv[1])
torch.set_num_threads(1)
tree = compile_tree(TREE_PRESETS[tree_name])
n, sc = tree.size, SamplingConfig(top_k=top_k, cfg_scale=cfg)
g = torch.Generator().manual_seed(0)
logits = torch.randn(b, 2, n, V, generator=g) * 3
q = warp(combine_cfg(torch.randn(2, n, V, generator=g) * 3, cfg, True), sc)[0]
tokens = torch.stack([torch.multinomial(q[max(int(tree.parent[i]), 0)], 1, generator=g)[0] for i in range(n)])
valid = torch.ones(n, dtype=torch.bool)
rule = Acceptance("exact")
times = []
for r in range(reps + 3):
    t0 = time.perf_counter()
    for i in range(b):
        p = warp(combine_cfg(logits[i].float().cpu(), cfg, True), sc)[0]
        walk_tree(p, tree.children, tokens, valid, q, rule, False, g, 255)
    times.append(time.perf_counter() - t0)
print(json.dumps(statistics.median(times[3:])))
"""


def time_after(b: int, reps: int) -> float:
    """Median seconds of this checkout's acceptance phase for B images."""
    from lantern.decoding.acceptance import Acceptance, DraftedTree, accept
    from lantern.decoding.config import DecodeConfig
    from lantern.decoding.sampling import GuidedLogits, SamplingConfig, candidates, combine_cfg, target_support

    strategy = DecodeConfig(drafting=TREE).strategy
    tree, placed = strategy.tree, strategy.on_device("cpu")
    n, sc = tree.size, SamplingConfig(top_k=TOP_K, cfg_scale=CFG)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * b, n, V, generator=g) * 3
    m = placed.children.shape[0]
    q = target_support(torch.randn(2 * b, m, V, generator=g) * 3, sc)  # (B, M, K) per parent
    cand, ok = candidates(q, placed.children.shape[1], False, g)
    tokens = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    real = placed.children >= 0
    tokens[:, placed.children[real]] = cand[:, real]
    valid[:, placed.children[real]] = ok[:, real]
    valid[:, 0] = True
    drafted = DraftedTree(tokens=tokens, valid=valid, depth=placed.depth, ancestors=placed.ancestors,
                          parents=placed.parents, children=placed.children[None], q=q, max_depth=tree.depth,
                          rank=placed.rank)
    rule = Acceptance("exact")
    times = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        accept(GuidedLogits(combine_cfg(logits, sc.cfg_scale, sc.use_cfg), sc), drafted, rule, False, g, V)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before-python", help="python of an environment with the previous revision installed")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "results" / "acceptance-phase-cpu"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for b in args.batches:
        row = {"images": b, "after_s": time_after(b, args.reps)}
        if args.before_python:
            res = subprocess.run([args.before_python, "-P", "-c", BEFORE, json.dumps([b, args.reps, V, TOP_K, CFG, TREE])],
                                 capture_output=True, text=True, check=True)
            row["before_s"] = json.loads(res.stdout)
        rows.append(row)
        print(row, file=sys.stderr)
    record = {"date": utc_now(), "machine": platform.processor(), "torch": torch.__version__, "threads": 1, "V": V,
              "top_k": TOP_K, "cfg": CFG, "tree": TREE, "reps": args.reps, "rows": rows}
    write_results(args.out, record, markdown)


def markdown(rec: dict) -> str:
    lines = [f"Acceptance phase (CFG + warp + acceptance + draws) at LlamaGen scale: V={V}, tree {TREE} (N=58), "
             f"top-k {TOP_K}, CFG {CFG}; CPU, 1 thread, median of {rec['reps']}; {rec['date']}.", "",
             "| images B | before (host walk, per image), ms | after (tensor program, batch), ms | after per image, ms |",
             "|---|---|---|---|"]
    for r in rec["rows"]:
        before = f"{1e3 * r['before_s']:.1f}" if "before_s" in r else "-"
        lines.append(f"| {r['images']} | {before} | {1e3 * r['after_s']:.1f} | {1e3 * r['after_s'] / r['images']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
