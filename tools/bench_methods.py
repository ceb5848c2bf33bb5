"""Speed and quality of every decoding method on one backend, side by side in one run.

For each (class, seed) the methods run back to back on the same runner set (so drift in machine load
hits all of them alike); speed-up = AR wall time / method wall time over the same images, against AR on the
same backend and against the fastest AR on this machine (tools/fastest_ar.py: AR on every mode that runs here,
eager, compiled, fused and ONNX, timed on the same images in the same run; named in the table). Quality: the bundle's
evaluator (class accuracy, Frechet distance to held-out real images). Writes
results/methods-<backend>-<dtype>.{json,md,png}, naming the CPU, commit and command.

    python tools/bench_methods.py [--backend cpu] [--dtype bf16] [--per-class 2] [--greedy]
                                  [--baseline-modes eager compiled fused onnx] [--tokens N] [--quick]

--quick checks that the tool runs (class 0, one image, AR and MC-SJD, eager baseline, 3 tokens, no quality, a
temporary output); its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch
from tqdm import tqdm

from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding import METHODS, SamplingConfig, method_preset
from lantern.embedded.evaluate import evaluate
from fastest_ar import ARBaseline, provenance, runnable_modes
from results_io import add_bundle_run_options, real_floor_row, utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_bundle_run_options(ap, "results/methods-<backend>-<dtype>")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:METHOD[:KEY=VALUE,...]",
                    help="one more row, e.g. 'lantern++ lam1.5:lantern++:lam=1.5' or "
                         "'chain-5 exact:lantern++:drafting=chain-5,lam=1'")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--baseline-modes", nargs="+", help="modes whose AR is the baseline (default: every mode "
                                                        "that runs the dtype here: eager, compiled, onnx)")
    ap.add_argument("--tokens", type=int, help="tokens per image (default: the whole image; fewer only to check "
                                               "the tool runs: quality is then not evaluated)")
    ap.add_argument("--quick", action="store_true", help="a check that the tool runs; its numbers mean nothing")
    args = ap.parse_args()
    if args.quick:
        import tempfile
        args.classes, args.per_class, args.methods, args.baseline_modes, args.tokens = [0], 1, ["ar", "mc-sjd"], \
            ["eager"], 3
        args.out = args.out or str(Path(tempfile.mkdtemp(prefix="lantern-methods-quick-")) / "methods")
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_bundle()
    classes = args.classes or list(range(bundle.target.config.num_classes))
    sampling = SamplingConfig(greedy=args.greedy, **bundle.default_sampling)
    configs = {m: method_preset(m, sampling) for m in args.methods}
    for spec in args.variant:
        label, method, overrides = (spec.split(":", 2) + [""])[:3]
        kv = dict(item.split("=", 1) for item in overrides.split(",") if item)
        configs[label] = method_preset(method, sampling, **{k: v if k == "drafting" else (int(v) if k == "k" else float(v))
                                                            for k, v in kv.items()})
    pipe = Pipeline(bundle.target, bundle.drafter, bundle.proximity, backend=args.backend, dtype=args.dtype)
    for dcfg in configs.values():  # prepare and warm up every static shape before timing anything
        pipe.runner(dcfg, 1)
    modes, left_out = runnable_modes(args.dtype, args.baseline_modes)
    baseline = ARBaseline(bundle.target, bundle.drafter, bundle.proximity, args.dtype, sampling, modes)
    jobs = [(c, s) for s in range(args.per_class) for c in classes]
    codes = {m: {} for m in configs}
    stats = {m: [] for m in configs}
    for c, s in tqdm(jobs, desc="images"):
        for m, dcfg in configs.items():
            r = pipe.generate([c], dcfg, seed=s, tokens=args.tokens)
            codes[m][(c, s)] = r.tokens
            stats[m].append(r.stats.summary())
        baseline.time([c], s, tokens=args.tokens)
    fastest = baseline.fastest()
    rows = []
    ar_wall = sum(st["wall_seconds"] for st in stats["ar"]) if "ar" in stats else None
    for m in configs:
        wall = sum(st["wall_seconds"] for st in stats[m])
        steps = sum(st["verify_steps"] for st in stats[m])
        tau = (sum(st["mean_accepted_length"] * st["verify_steps"] for st in stats[m]) / steps) if steps else 1.0
        fwd = sum(st["target_forwards"] for st in stats[m])
        tokens = sum(st["tokens"] for st in stats[m])
        tv = [st["token_tv_max"] for st in stats[m]]
        order = {(c, s): i for i, (c, s) in enumerate((c, s) for c in classes for s in range(args.per_class))}
        by_chunk = sorted(codes[m].items(), key=lambda kv: order[kv[0]])
        quality = evaluate(bundle, lambda _chunk, i, _b=by_chunk: _b[i][1], classes=classes,
                           n_per_class=args.per_class, seed=0, batch_size=1) if args.tokens is None else None
        rows.append({
            "method": m, "decode": configs[m].to_dict(), "images": len(jobs), "wall_seconds": wall,
            "seconds_per_image": wall / len(jobs), "speedup_vs_ar": (ar_wall / wall) if ar_wall else None,
            "speedup_vs_fastest_ar": fastest["total_s"] / wall,
            "mean_accepted_length": tau, "step_compression": tokens / fwd, "tokens_per_second": tokens / wall,
            "token_tv_max": max(tv, default=0.0),
            "class_accuracy": quality["generated"]["class_accuracy"] if quality else None,
            "frechet_distance": quality["generated"]["frechet_distance"] if quality else None,
        })
    reference = quality["real_train_reference"] if quality else None
    out = Path(args.out or ROOT / "results" / f"methods-{args.backend}-{args.dtype}")
    record = {"backend": args.backend, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__, **provenance(),
              "fastest_ar": fastest, "baseline_modes_left_out": left_out, "quick": args.quick,
              "bundle": bundle.manifest.get("name", str(bundle.path)), "greedy": args.greedy,
              "cfg_scale": sampling.cfg_scale, "classes": classes, "per_class": args.per_class,
              "date": utc_now(), "rows": rows, "real_image_reference": reference}
    write_results(out, record, markdown, plot)


def markdown(rec: dict) -> str:
    fa = rec["fastest_ar"]
    lines = [f"Backend `{rec['backend']}` {rec['dtype']}, {rec['threads']} threads, {rec['cpu']}, torch "
             f"{rec['torch']}; {len(rec['classes'])} classes x {rec['per_class']} images, "
             f"{'greedy' if rec['greedy'] else 'sampling'}, CFG {rec['cfg_scale']}; {rec['date']}; commit "
             f"{rec['commit']}; `{rec['command']}`.", "",
             f"Fastest AR on this machine: {fa['mode']} (`{fa['backend']}`), {fa['total_s'] / len(fa['walls']):.2f} s "
             "/ image; AR per mode (s / image): " + ", ".join(
                 f"{m} {t / len(fa['walls']):.2f}" for m, t in fa["total_by_mode"].items()) + "".join(
                 f"; {m} not run ({why})" for m, why in rec["baseline_modes_left_out"].items()) + ".", "",
             "| method | s / image | speed-up vs fastest AR | speed-up vs AR (same backend) | tau (mean accepted) | "
             "step compression | class acc. | Frechet dist. | max token TV (bounded rule) |",
             "|---|---|---|---|---|---|---|---|---|"]
    if rec.get("quick"):
        lines[1:1] = ["", "**--quick: a check that the tool runs; the numbers mean nothing.**"]

    def num(x):
        return "-" if x is None else f"{x:.2f}"
    for r in rec["rows"]:
        sp = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        lines.append(f"| {r['method']} | {r['seconds_per_image']:.2f} | {r['speedup_vs_fastest_ar']:.2f}x | {sp} | "
                     f"{r['mean_accepted_length']:.2f} | {r['step_compression']:.2f} | {num(r['class_accuracy'])} | "
                     f"{num(r['frechet_distance'])} | {r['token_tv_max']:.3f} |")
    if rec["real_image_reference"]:
        lines.append(real_floor_row(rec["real_image_reference"], blanks=5))
    return "\n".join(lines) + "\n"


def plot(rec: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if rec["real_image_reference"] is None:
        return  # no quality measured (--tokens)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for r in rec["rows"]:
        sp = r["speedup_vs_fastest_ar"]
        axes[0].scatter(sp, r["frechet_distance"], s=40)
        axes[0].annotate(r["method"], (sp, r["frechet_distance"]), textcoords="offset points", xytext=(4, 4))
        axes[1].bar(r["method"], r["mean_accepted_length"])
    axes[0].axhline(rec["real_image_reference"]["frechet_distance"], ls="--", c="gray", label="real images")
    axes[0].set_xlabel(f"speed-up over the fastest AR ({rec['fastest_ar']['mode']}, wall clock)")
    axes[0].set_ylabel("Frechet distance (lower is better)")
    axes[0].legend()
    axes[1].set_ylabel("mean accepted length (tau)")
    fig.suptitle(f"{rec['backend']} {rec['dtype']}: speed vs quality")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
