"""ONNX Runtime vs torch eager on this machine, side by side in one run.

Reports (1) target verify latency against the tree width N (plus the prefill), with the parity error of
every step, and (2) whole-generation wall time, AR and speculative (LANTERN++ tree), greedy with CFG, on
both backends, checking the token ids are equal. Writes results/onnx-bench.{json,md}.

The model has the GPT-small shape (dim 384, 8 layers, 8 heads, vocab 1024, 10 classes, 256 tokens: larger
than the embedded model, preset GPT-lantern-digits) with RANDOM weights and a random drafter: fine for
timing, but acceptance (tau) is not representative of a trained drafter.

    python tools/bench_onnx.py                 # the full run (several minutes on 2 cores)
    python tools/bench_onnx.py --quick         # a smoke run on GPT-test
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from lantern.files import atomic_io
from lantern.api import Pipeline
from lantern.backends import StaticSpec, get_backend
from lantern.models.config import gpt_preset
from lantern.decoding import TREE_PRESETS, SamplingConfig, compile_tree, method_preset
from lantern.engine import Engine, Request
from lantern.engine.step import static_spec
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT
from lantern.models.proximity import build_proximity_table

BACKENDS = ("cpu", "onnx")
RESULTS = Path(__file__).resolve().parents[1] / "results"


def interleaved_ms(calls: dict, reps: int) -> dict:
    """{backend: {median_ms, min_ms}} of `reps` calls each, the backends alternating call by call so that
    load from other jobs on the machine falls on both alike."""
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t)} for name, t in times.items()}


def verify_latency(target, widths, threads: int, reps: int, cache_dir: str) -> dict:
    """Median ms of prefill and of verify[N] for each N, both backends, alternating per width."""
    cfg = target.config
    spec = StaticSpec(batch=2, max_len=(cfg.seq_len + max(widths) + 7) // 8 * 8, prefix_len=cfg.cls_token_num,
                      verify_widths=tuple(widths))
    runners, prepare_s = {}, {}
    for name in BACKENDS:
        t0 = time.perf_counter()
        runners[name] = backend(name, threads, cache_dir).prepare(target, None, spec)
        prepare_s[name] = time.perf_counter() - t0
        runners[name].warmup()
    t0 = time.perf_counter()
    backend("onnx", threads, cache_dir).prepare(target, None, spec)  # every graph now cached: sessions only
    prepare_s["onnx (cached graphs)"] = time.perf_counter() - t0
    s, p = spec.max_len, spec.prefix_len
    cond = torch.tensor([1, cfg.null_class])
    pmask = (torch.arange(s)[None, None, :] < p).expand(2, p, s)
    rows = [{"step": "prefill", **interleaved_ms({b: lambda r=runners[b]: r.prefill(cond, pmask) for b in BACKENDS}, reps),
             "max_abs_logit_diff": max_diff(runners, "prefill", cond, pmask)}]
    base = p + cfg.block_size // 2  # mid-image: half the image is in the cache
    for n in widths:
        tree = next((compile_tree(paths) for paths in TREE_PRESETS.values() if len(paths) + 1 == n), None)
        mask_tree = tree.mask if tree is not None else torch.tril(torch.ones(n, n, dtype=torch.bool))
        depth = tree.node_depth if tree is not None else torch.arange(n)
        tokens = torch.randint(0, cfg.vocab_size, (2, n), generator=torch.Generator().manual_seed(n))
        positions = (base + depth)[None].expand(2, n).contiguous()
        slots = (base + torch.arange(n))[None].expand(2, n).contiguous()
        mask = torch.zeros(2, n, s, dtype=torch.bool)
        mask[:, :, :base] = True
        mask[:, :, base:base + n] = mask_tree
        args = (tokens, positions, slots, mask)
        rows.append({"step": f"verify[{n}]", "tree": tree_name(n),
                     **interleaved_ms({b: lambda r=runners[b]: r.verify(*args) for b in BACKENDS}, reps),
                     "max_abs_logit_diff": max_diff(runners, "verify", *args)})
    return {"spec": asdict(spec), "prepare_s": prepare_s, "rows": rows,
            "profiles": {b: runners[b].profile() for b in BACKENDS}}


def tree_name(n: int) -> str:
    return next((k for k, v in TREE_PRESETS.items() if len(v) + 1 == n), "chain" if n > 1 else "AR step")


def max_diff(runners, step: str, *args) -> float:
    outs = {b: getattr(runners[b], step)(*args) for b in BACKENDS}
    return (outs["onnx"].logits - outs["cpu"].logits).abs().max().item()


def backend(name: str, threads: int, cache_dir: str):
    return get_backend(name, threads=threads, **({"cache_dir": cache_dir} if name == "onnx" else {}))


def generation(target, drafter, method: str, tree: str, threads: int, cache_dir: str, proximity) -> dict:
    """Greedy CFG generation of one image on both backends: wall time, token equality, tau."""
    cfg = target.config
    overrides = {"drafting": tree} if method != "ar" else {}
    dcfg = method_preset(method, SamplingConfig(greedy=True, cfg_scale=4.0), **overrides)
    spec = static_spec(dcfg, cfg, batch=1, dtype="fp32")
    out = {"method": method, "tree": tree if method != "ar" else None, "spec": asdict(spec)}
    tokens = {}
    for name in BACKENDS:
        runner = backend(name, threads, cache_dir).prepare(target, drafter if dcfg.speculative else None, spec)
        runner.warmup()
        engine = Engine(Pipeline(target, drafter, proximity, backend="cpu"), dcfg, 1, runner=runner)
        engine.submit(Request(3, seed=0))
        (result,) = engine.run()
        tokens[name], stats = result.tokens, result.stats
        out[name] = {"wall_s": result.finished_s - result.started_s, "target_forwards": stats.target_forwards,
                     "draft_forwards": engine.steps_run * engine.proposer.drafter_calls,
                     "tau": stats.mean_accepted_length,
                     "phases": {k: v.summary() for k, v in runner.times.items()}}
    out["tokens_equal"] = bool(torch.equal(tokens["cpu"].flatten(), tokens["onnx"].flatten()))
    return out


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# ONNX Runtime vs torch eager ({result['model']['preset']}, random weights)", "",
             f"{m['cpus']} CPUs shared with other jobs (load average {m['loadavg_start']} at start, "
             f"{m['loadavg_end']} at end), {result['threads']} thread(s) per backend, torch {m['torch']}, "
             f"onnxruntime {m['onnxruntime']}. Random weights and a random drafter: timing only, tau is not "
             "a trained drafter's. Step latencies: the two backends alternate call by call.", "",
             "## Target step latency (batch 2 = CFG rows)", "",
             "| step | tree | torch eager ms (median / min) | onnx ms (median / min) | onnx speed-up (median) "
             "| max abs logit diff |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in result["verify"]["rows"]:
        c, o = r["cpu"], r["onnx"]
        lines.append(f"| {r['step']} | {r.get('tree', '')} | {c['median_ms']:.1f} / {c['min_ms']:.1f} | "
                     f"{o['median_ms']:.1f} / {o['min_ms']:.1f} | {c['median_ms'] / o['median_ms']:.2f}x | "
                     f"{r['max_abs_logit_diff']:.2e} |")
    prep = result["verify"]["prepare_s"]
    lines += ["", f"Preparing these {len(result['verify']['rows'])} target steps: torch {prep['cpu']:.1f} s; onnx "
              f"{prep['onnx']:.1f} s exporting into an empty graph cache and opening the sessions, "
              f"{prep['onnx (cached graphs)']:.1f} s with every graph cached (sessions only)."]
    lines += ["", "## Whole generation (1 image, 256 tokens, greedy, CFG 4)", "",
              "| method | torch eager s | onnx s | onnx speed-up | tau | target forwards | same tokens |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for g in result["generation"]:
        label = g["method"] + (f" ({g['tree']})" if g["tree"] else "")
        lines.append(f"| {label} | {g['cpu']['wall_s']:.2f} | {g['onnx']['wall_s']:.2f} | "
                     f"{g['cpu']['wall_s'] / g['onnx']['wall_s']:.2f}x | {g['onnx']['tau']:.2f} | "
                     f"{g['onnx']['target_forwards']} | {g['tokens_equal']} |")
    lines += ["", "## Memory (the verify-latency runners: prefill + every width above)", "",
              "| backend | peak RSS MiB | weights MiB | KV cache MiB | workspace MiB | source |",
              "| --- | ---: | ---: | ---: | ---: | --- |"]
    for b in BACKENDS:
        mem = result["verify"]["profiles"][b]["memory"]
        lines.append(f"| {b} | {mem['peak_bytes'] / 2**20:.0f} | {mem['weights_bytes'] / 2**20:.1f} | "
                     f"{mem['kv_cache_bytes'] / 2**20:.1f} | {mem['workspace_bytes'] / 2**20:.1f} | {mem['source']} |")
    lines += ["", "Both backends run in one process, so peak RSS is the process's, not either backend's alone. "
              "The onnx weights are the graph files: each session holds its own copy of the target's weights "
              "(one per static step), so they grow with the number of widths prepared."]
    ort = result["verify"]["profiles"]["onnx"]["ort"]
    lines += ["", f"ORT session options: `{json.dumps(ort['session_options'])}`", "",
              "ORT arena per step (mem_in_use_peak bytes): " + ", ".join(
                  f"{k} {v['mem_in_use_peak']}" for k, v in ort["memory_per_step"].items()), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="GPT-test, few reps: a smoke run, nothing written")
    # 1 by default: where other jobs share the cores, torch's OpenMP pool waits at barriers for a descheduled
    # thread, which would say nothing about ONNX
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--cache-dir", default=None, help="ONNX graph cache (default: a temporary folder)")
    ap.add_argument("--out", default=str(RESULTS / "onnx-bench"), help="results path without suffix")
    args = ap.parse_args()

    import onnxruntime

    preset = "GPT-test" if args.quick else "GPT-small"
    reps = 3 if args.quick else args.reps
    torch.manual_seed(0)
    target = GPT(gpt_preset(preset)).eval()
    drafter = Drafter(target.config).eval()
    codebook = torch.nn.functional.normalize(torch.randn(target.config.vocab_size, 8), dim=1)
    proximity = build_proximity_table(codebook, 10)
    widths = sorted({1} | {len(p) + 1 for p in TREE_PRESETS.values()})
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or tmp
        result = {"model": {"preset": preset, **target.config.to_dict(), "weights": "random (seed 0)"},
                  "threads": args.threads,
                  "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                              "onnxruntime": onnxruntime.__version__,
                              "loadavg_start": [round(x, 2) for x in os.getloadavg()]}}
        result["verify"] = verify_latency(target, widths, args.threads, reps, cache_dir)
        result["generation"] = [generation(target, drafter, "ar", "", args.threads, cache_dir, proximity),
                                generation(target, drafter, "lantern++", "lantern++-57", args.threads, cache_dir,
                                           proximity)]
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = markdown(result)
    print(text)
    if not args.quick:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_io.write_text(out.with_suffix(".json"), json.dumps(result, indent=1, default=str))
        atomic_io.write_text(out.with_suffix(".md"), text)
        print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
