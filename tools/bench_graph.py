"""Eager vs graph mode on CPU (`cpu` vs `cpu-graph`), AR and LANTERN++, side by side in one run.

    python tools/bench_graph.py [--images 3] [--threads 1] [--dtype fp32] [--compiler inductor]

The model has the GPT-small shape (dim 384, 8 layers, 8 heads, vocab 1024, 10 classes, 256 tokens: larger than
the embedded model, preset GPT-lantern-digits) with RANDOM weights (output head scaled x8 for peaked
distributions) and a random drafter: the timings are real, the acceptance lengths are not a trained model's.
Both backends decode the same classes with the same seeds, interleaved image by image so a change of machine
load hits both; greedy decoding, so their token ids must agree (checked). Warm-up (for graph
mode: every compile and capture) is timed apart from generation, and dynamo's own counter says how many graphs
were compiled in warm-up and after it. Writes <out>.json and <out>.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from lantern.files import atomic_io
from lantern.api import Pipeline
from lantern.models.config import gpt_preset
from lantern.decoding import SamplingConfig, method_preset
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT
from lantern.models.proximity import build_proximity_table

BACKENDS = ("cpu", "cpu-graph")


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def inductor_cache() -> tuple[int, int]:
    """(hits, misses) of inductor's on-disk graph cache: a hit skips the C++ compile, so warm-up is short."""
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def random_models(preset: str, seed: int):
    torch.manual_seed(seed)
    cfg = gpt_preset(preset)
    target, drafter = GPT(cfg).eval(), Drafter(cfg).eval()
    with torch.no_grad():
        target.output.weight.mul_(8.0)  # peaked distributions, like a trained model's (as tests/conftest.py does)
    codebook = torch.nn.functional.normalize(torch.randn(cfg.vocab_size, 8), dim=1)
    return target, drafter, build_proximity_table(codebook, 10)


def add_speedups(eager: dict, graph: dict) -> None:
    """Graph over eager: ratio of the medians, and the median of per-image ratios (the same image decoded by
    both back to back, so a change of machine load mostly cancels)."""
    eager["speedup_vs_eager"] = eager["paired_speedup_vs_eager"] = 1.0
    graph["speedup_vs_eager"] = eager["median_s_per_image"] / graph["median_s_per_image"]
    graph["paired_speedup_vs_eager"] = statistics.median(e / g for e, g in zip(eager["seconds"], graph["seconds"]))


def bench_method(method: str, models, args) -> list[dict]:
    target, drafter, proximity = models
    dcfg = method_preset(method, SamplingConfig(greedy=True, cfg_scale=args.cfg_scale))
    options = {"cpu": {}, "cpu-graph": {"compiler": args.compiler}}
    pipes, rows = {}, {}
    for name in BACKENDS:
        pipes[name] = Pipeline(target, drafter, proximity, backend=name, dtype=args.dtype, threads=args.threads,
                               **options[name])
        before, cache_before, t0 = graphs_compiled(), inductor_cache(), time.perf_counter()
        runner = pipes[name].runner(dcfg, 1)  # prepare + warm-up: every graph compiled and captured here
        hits, misses = (a - b for a, b in zip(inductor_cache(), cache_before))
        rows[name] = {"method": method, "backend": name, "prepare_and_warmup_s": time.perf_counter() - t0,
                      "warmup_s": runner.warmup_seconds, "graphs_compiled_in_warmup": graphs_compiled() - before,
                      "inductor_cache_hits": hits, "inductor_cache_misses": misses,
                      "graph_keys": getattr(runner, "graph_keys", lambda: [])(), "seconds": [], "ids": [],
                      "tau": [], "target_forwards": [], "phases": [], "memory": None}
        print(f"[{method}] {name}: warm-up {runner.warmup_seconds:.1f} s, "
              f"{rows[name]['graphs_compiled_in_warmup']} graphs compiled", file=sys.stderr)
    before = graphs_compiled()
    for i in range(args.images):
        cls = i % target.config.num_classes
        for name in BACKENDS:
            res = pipes[name].generate([cls], dcfg, seed=i)
            row = rows[name]
            row["seconds"].append(res.stats.wall_seconds)
            row["ids"].append(res.tokens[0].tolist())
            row["tau"].append(res.stats.mean_accepted_length if dcfg.speculative else 1.0)
            row["target_forwards"].append(res.stats.target_forwards)
            row["phases"].append(res.profile["phases"])
            row["memory"] = res.profile["memory"]
            print(f"[{method}] {name} image {i} (class {cls}): {res.stats.wall_seconds:.2f} s", file=sys.stderr)
    recompiles = graphs_compiled() - before
    block = target.config.block_size
    for name in BACKENDS:
        row = rows[name]
        row["recompiles_after_warmup"] = recompiles if name == "cpu-graph" else 0
        row["median_s_per_image"] = statistics.median(row["seconds"])
        row["tokens_per_s"] = block / row["median_s_per_image"]
        row["mean_tau"] = statistics.mean(row["tau"])
        row["target_forwards_per_image"] = statistics.mean(row["target_forwards"])
        row["ids_equal_eager"] = row["ids"] == rows["cpu"]["ids"]
    add_speedups(rows["cpu"], rows["cpu-graph"])
    for row in rows.values():
        del row["ids"]
    return list(rows.values())


PHASES = ("prefill", "decode", "draft", "verify", "accept", "commit")


def phase_mean(row: dict, name: str) -> float:
    return statistics.mean(p.get(name, {}).get("total_s", 0.0) for p in row["phases"])


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        f"# Graph mode vs eager on CPU ({record['date']})",
        "",
        f"Model: {record['settings']['preset']} shape ({record['model']['n_layer']} layers, dim {record['model']['dim']}, "
        f"vocab {record['model']['vocab_size']}, {record['model']['block_size']} tokens), **random weights** "
        f"(output head x8) and a random drafter (timings are real; acceptance lengths are not a trained model's). "
        f"{record['settings']['dtype']}, greedy, CFG {record['settings']['cfg_scale']}, "
        f"{record['settings']['images']} images per row, one at a time, interleaved eager/graph. "
        f"Graph mode: torch.compile(backend={record['settings']['compiler']}, fullgraph=True, dynamic=False). "
        f"torch {m['torch']}, {m['threads']} thread(s) on {m['cpus']} cores; load average "
        f"{m['load_before'][0]:.1f} before, {m['load_after'][0]:.1f} after (other jobs shared the machine).",
        "",
        "| method | backend | warm-up s | graphs compiled (inductor cache hits/misses) | recompiles after warm-up "
        "| median s/image | tokens/s | speed-up vs eager (medians; paired) | tau | target forwards/image "
        "| ids = eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        lines.append(f"| {r['method']} | {r['backend']} | {r['warmup_s']:.1f} | {r['graphs_compiled_in_warmup']} "
                     f"({r['inductor_cache_hits']}/{r['inductor_cache_misses']}) | "
                     f"{r['recompiles_after_warmup']} | {r['median_s_per_image']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['speedup_vs_eager']:.2f}x; {r['paired_speedup_vs_eager']:.2f}x | {r['mean_tau']:.2f} | {r['target_forwards_per_image']:.0f} | "
                     f"{'yes' if r['ids_equal_eager'] else 'NO'} |")
    lines += ["", "Seconds per image by phase (mean over images; the device synced at each phase's ends):", "",
              "| method | backend | " + " | ".join(PHASES) + " |", "|---|---|" + "---|" * len(PHASES)]
    for r in record["results"]:
        cells = [f"{phase_mean(r, name):.2f}" if any(name in p for p in r["phases"]) else "-" for name in PHASES]
        lines.append(f"| {r['method']} | {r['backend']} | " + " | ".join(cells) + " |")
    sp = record["method_speedups"]
    lines += ["", "LANTERN++ over AR (median latency, same backend): "
              + ", ".join(f"{b} {v:.2f}x" for b, v in sp.items()) + "."]
    if any(r["method"] != "ar" and r["mean_tau"] < 1.05 for r in record["results"]):
        lines += ["", "tau near 1: the random drafter almost never agrees with the random target, so speculative "
                      "decoding here pays a whole tree verification per token. That is its worst case, not its speed; "
                      "compare eager and graph mode within a method, not the methods."]
    lines += ["",
              f"Rerun: `{record['command']}`", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=3, help="images per method and backend (classes 0, 1, ...)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (1 resists a shared machine's load)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--compiler", default="inductor", help="torch.compile backend for cpu-graph")
    ap.add_argument("--cfg-scale", type=float, default=4.0)
    ap.add_argument("--methods", default="ar,lantern++")
    ap.add_argument("--preset", default="GPT-small", help="model shape (GPT-test for a quick smoke run)")
    ap.add_argument("--out", default="results/graph-cpu", help="output path without extension")
    args = ap.parse_args(argv)
    models = random_models(args.preset, seed=0)
    load_before = os.getloadavg()
    results = []
    for method in args.methods.split(","):
        results += bench_method(method, models, args)
    median = {(r["method"], r["backend"]): r["median_s_per_image"] for r in results}
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python tools/bench_graph.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": models[0].config.to_dict(),
        "weights": "random (torch.manual_seed(0)), target output head x8, random drafter",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                    "threads": args.threads, "load_before": load_before, "load_after": os.getloadavg()},
        "results": results,
        "method_speedups": ({b: median[("ar", b)] / median[("lantern++", b)] for b in BACKENDS}
                            if {"ar", "lantern++"} <= {r["method"] for r in results} else {}),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_io.write_text(out.with_suffix(".json"), json.dumps(record, indent=1))
    atomic_io.write_text(out.with_suffix(".md"), markdown(record))
    print(markdown(record))
    return 0 if all(r["ids_equal_eager"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
