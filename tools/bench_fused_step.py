"""Per-step time of the fused step (the engine's whole step as one graph) against per-module graphs and eager.

    python tools/bench_fused_step.py [--dtype fp32] [--threads 2] [--images 2] [--compiler inductor]
    python tools/bench_fused_step.py --quick     # checks that it runs, on a tiny random model: numbers mean nothing

Three ways of running the same step on the CPU: `cpu` (eager), `cpu-graph` (one graph per forward, eager glue
around them) and `cpu-graph` with `fused_step=True` (lantern.engine.fused: propose, verify, accept, commit and
emit in one graph). For AR and each speculative method (the embedded bundle's model and sampling; a static tree
and EAGLE-2's dynamic tree need its drafter), every mode decodes the same classes and seeds one image at a time
through the step engine; the modes take turns image by image so a slow spell of the machine hits all alike.
Per-step time = the image's wall / its steps (its prefill included: the same in every mode). Warm-up (compile)
is reported apart, with the fused step's own compile (paid at its first steps). Tokens are compared with eager's
(a mismatch is reported, not hidden). Writes results/fused-step-<dtype>. Timing wants a quiet machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from lantern.api import Pipeline
from lantern.decoding import SamplingConfig, method_preset
from lantern.engine import Engine, Request
from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
MODES = {"eager": ("cpu", {}), "per-module graphs": ("cpu-graph", {}),
         "fused step": ("cpu-graph", {"fused_step": True})}


def methods(sampling: SamplingConfig, window: int, relaxation: dict, quick: bool) -> dict:
    dynamic = dict(dynamic_depth=3, dynamic_top_k=3, dynamic_total=10) if quick else {}
    return {"AR": method_preset("ar", sampling),
            "LANTERN++ chain-5": method_preset("lantern++", sampling, drafting="chain-5",
                                               **relaxation.get("lantern++", {})),
            "LANTERN++ static tree": method_preset("lantern++", sampling, **relaxation.get("lantern++", {})),
            "EAGLE-2 dynamic tree": method_preset("eagle2", sampling, **dynamic),
            f"MC-SJD L={window}": method_preset("mc-sjd", sampling, window=window),
            f"MC-SJD relaxed L={window}": method_preset("mc-sjd-relaxed", sampling, window=window,
                                                        **relaxation.get("mc-sjd-relaxed", {}))}


def one_image(pipe, dcfg, cls: int, seed: int) -> tuple[float, int, list]:
    """(wall seconds, steps, tokens) of one image through a width-1 engine (its runner prepared already)."""
    engine = Engine(pipe, dcfg, 1)
    engine.submit(Request(cls, seed))
    t0 = time.perf_counter()
    (result,) = engine.run()
    return time.perf_counter() - t0, engine.steps_run, result.tokens.tolist()


def models(args):
    if args.quick:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import make_models
        from lantern.models.config import gpt_preset
        target, drafter, proximity = make_models(gpt_preset("GPT-test"))
        return target, drafter, proximity, SamplingConfig(cfg_scale=2.0, top_k=20), {}
    from lantern.bundle import load_bundle
    bundle = load_bundle()
    return (bundle.target, bundle.drafter, bundle.proximity, SamplingConfig(**bundle.default_sampling),
            bundle.relaxation_defaults)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--images", type=int, default=2, help="images per method and mode (classes 0, 1, ...)")
    ap.add_argument("--window", type=int, default=16, help="Jacobi window L")
    ap.add_argument("--compiler", default="inductor", help="torch.compile backend of the graph modes")
    ap.add_argument("--only", nargs="+", metavar="WORD",
                    help="only the methods whose name contains one of these words (e.g. AR chain relaxed)")
    ap.add_argument("--quick", action="store_true", help="a tiny random model, one image: checks that it runs")
    ap.add_argument("--out", help="output stem (default results/fused-step-<dtype>)")
    args = ap.parse_args()
    if args.images < 1:
        ap.error(f"--images {args.images} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.images, args.window, args.compiler = 1, 4, "eager"
    target, drafter, proximity, sampling, relaxation = models(args)
    configs = methods(sampling, args.window, relaxation, args.quick)
    if args.only:
        configs = {name: c for name, c in configs.items() if any(w.lower() in name.lower() for w in args.only)}
        if not configs:
            every = methods(sampling, args.window, relaxation, args.quick)
            ap.error(f"--only {' '.join(args.only)} matches no method of {', '.join(every)}")
    pipes = {}
    for mode, (backend, options) in MODES.items():
        graph = {"compiler": args.compiler, **options} if backend == "cpu-graph" else {}
        pipes[mode] = Pipeline(target, drafter, proximity, backend=backend, dtype=args.dtype, threads=args.threads,
                               **graph)
    classes = [i % target.config.num_classes for i in range(args.images)]
    rows = []
    for name, dcfg in configs.items():
        runs = {mode: [] for mode in MODES}
        warmup = {}
        for mode, pipe in pipes.items():
            runner = pipe.runner(dcfg, 1)
            one_image(pipe, dcfg, classes[0], 0)  # untimed: the fused step compiles at its first steps
            warmup[mode] = {"warmup_s": runner.warmup_seconds,
                            "fused_warmup_s": getattr(runner, "fused_warmup_seconds", 0.0),
                            "graphs": getattr(runner, "graph_keys", lambda: [])(),
                            "step": runner.profile().get("step", "eager")}
        for i, cls in enumerate(classes):
            order = list(MODES) if i % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                runs[mode].append(one_image(pipes[mode], dcfg, cls, i))
        eager_tokens = [tokens for _, _, tokens in runs["eager"]]
        for mode in MODES:
            walls, steps = [w for w, _, _ in runs[mode]], [s for _, s, _ in runs[mode]]
            rows.append({"method": name, "mode": mode, "ms_per_step": 1e3 * sum(walls) / sum(steps),
                         "median_s_per_image": statistics.median(walls), "steps": sum(steps),
                         "same_tokens_as_eager": [t for _, _, t in runs[mode]] == eager_tokens, **warmup[mode]})
        print(f"{name}: " + ", ".join(f"{r['mode']} {r['ms_per_step']:.2f} ms/step" for r in rows[-len(MODES):]),
              file=sys.stderr, flush=True)
    record = {"dtype": args.dtype, "threads": torch.get_num_threads(), "compiler": args.compiler,
              "images": args.images, "window": args.window, "quick": args.quick, "date": utc_now(), "rows": rows}
    write_results(args.out or ROOT / "results" / f"fused-step-{args.dtype}", record, markdown)


def markdown(rec: dict) -> str:
    lines = [f"Per-step time, {rec['images']} image(s) per method and mode, {rec['dtype']}, {rec['threads']} "
             f"thread(s), compiler {rec['compiler']}" + (" (--quick: a tiny random model, numbers mean nothing)"
                                                          if rec["quick"] else ""), "",
             "| method | mode | ms / step | steps | warm-up s | fused step compile s | same tokens as eager |",
             "|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        lines.append(f"| {r['method']} | {r['mode']} | {r['ms_per_step']:.2f} | {r['steps']} | {r['warmup_s']:.1f} "
                     f"| {r['fused_warmup_s']:.1f} | {'yes' if r['same_tokens_as_eager'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
