"""Speed and quality of every decoding method on one backend, side by side in one run.

For each (class, seed) the methods run back to back on the same runner set (so drift in machine load
hits all of them alike); speed-up = AR wall time / method wall time over the same images. Quality: the
bundle's evaluator (class accuracy, Frechet distance to held-out real images). Writes
results/methods-<backend>-<dtype>.{json,md,png}.

    python tools/bench_methods.py [--backend cpu] [--dtype bf16] [--per-class 2] [--greedy]
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
from lantern.evaluate import evaluate
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
    args = ap.parse_args()
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
    jobs = [(c, s) for s in range(args.per_class) for c in classes]
    codes = {m: {} for m in configs}
    stats = {m: [] for m in configs}
    for c, s in tqdm(jobs, desc="images"):
        for m, dcfg in configs.items():
            r = pipe.generate([c], dcfg, seed=s)
            codes[m][(c, s)] = r.tokens
            stats[m].append(r.stats.summary())
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
                           n_per_class=args.per_class, seed=0, batch_size=1)
        rows.append({
            "method": m, "decode": configs[m].to_dict(), "images": len(jobs), "wall_seconds": wall,
            "seconds_per_image": wall / len(jobs), "speedup_vs_ar": (ar_wall / wall) if ar_wall else None,
            "mean_accepted_length": tau, "step_compression": tokens / fwd, "tokens_per_second": tokens / wall,
            "token_tv_max": max(tv, default=0.0),
            "class_accuracy": quality["generated"]["class_accuracy"],
            "frechet_distance": quality["generated"]["frechet_distance"],
        })
    reference = quality["real_train_reference"]
    out = Path(args.out or ROOT / "results" / f"methods-{args.backend}-{args.dtype}")
    record = {"backend": args.backend, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "bundle": bundle.manifest.get("name", str(bundle.path)), "greedy": args.greedy,
              "cfg_scale": sampling.cfg_scale, "classes": classes, "per_class": args.per_class,
              "date": utc_now(), "rows": rows, "real_image_reference": reference}
    write_results(out, record, markdown, plot)


def markdown(rec: dict) -> str:
    lines = [f"Backend `{rec['backend']}` {rec['dtype']}, {rec['threads']} threads, {rec['machine']}, torch "
             f"{rec['torch']}; {len(rec['classes'])} classes x {rec['per_class']} images, "
             f"{'greedy' if rec['greedy'] else 'sampling'}, CFG {rec['cfg_scale']}; {rec['date']}.", "",
             "| method | s / image | speed-up vs AR | tau (mean accepted) | step compression | class acc. | "
             "Frechet dist. | max token TV (bounded rule) |", "|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        sp = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        lines.append(f"| {r['method']} | {r['seconds_per_image']:.2f} | {sp} | {r['mean_accepted_length']:.2f} | "
                     f"{r['step_compression']:.2f} | {r['class_accuracy']:.2f} | {r['frechet_distance']:.2f} | "
                     f"{r['token_tv_max']:.3f} |")
    lines.append(real_floor_row(rec["real_image_reference"], blanks=4))
    return "\n".join(lines) + "\n"


def plot(rec: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for r in rec["rows"]:
        sp = r["speedup_vs_ar"] or 1.0
        axes[0].scatter(sp, r["frechet_distance"], s=40)
        axes[0].annotate(r["method"], (sp, r["frechet_distance"]), textcoords="offset points", xytext=(4, 4))
        axes[1].bar(r["method"], r["mean_accepted_length"])
    axes[0].axhline(rec["real_image_reference"]["frechet_distance"], ls="--", c="gray", label="real images")
    axes[0].set_xlabel("speed-up over AR (wall clock)")
    axes[0].set_ylabel("Frechet distance (lower is better)")
    axes[0].legend()
    axes[1].set_ylabel("mean accepted length (tau)")
    fig.suptitle(f"{rec['backend']} {rec['dtype']}: speed vs quality")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
