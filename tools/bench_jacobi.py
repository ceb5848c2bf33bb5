"""Jacobi decoding (no drafter) against AR and a drafter method on the embedded model, side by side in one run.

Two settings: one image at a time (batch 1), and all the classes in one batch. Rows: AR, SJD, MC-SJD at each
window, relaxed MC-SJD, and EAGLE-style methods (the trained drafter, exact acceptance). For each image (or
batch) the methods run back to back, in alternating order, so drift in machine load hits all of them alike;
speed-up = AR's decode wall time / the method's over the same images. With `--repeats R` every job runs R
times per method and counts its median run (the middle one by wall time; of an even R, the faster middle one):
a machine has fast spells as well as slow ones, and a fastest run would count a lucky one. Quality: the
bundle's evaluator (class accuracy, Frechet distance to held-out real images), per setting and method. Writes
results/jacobi-<backend>.{json,md}. Timing wants a quiet machine.

    python tools/bench_jacobi.py [--per-class 2] [--windows 8 16 32] [--eagle chain-5 lantern++-57] [--threads 2]
                                 [--repeats 3]
    python tools/bench_jacobi.py --classes 0 1 --per-class 1 --windows 4 --out /tmp/jacobi-smoke   # smoke run
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from lantern.files import atomic_io
from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding import DecodeConfig, SamplingConfig, method_preset
from lantern.embedded.evaluate import evaluate
from results_io import add_bundle_run_options, real_floor_row

ROOT = Path(__file__).resolve().parents[1]


def methods(sampling: SamplingConfig, windows: list[int], relaxed_window: int, eagle: list[str],
            relaxation: dict) -> dict[str, DecodeConfig]:
    """relaxation: the relaxed row's settings (the bundle's validated ones; {} = the preset's)."""
    rows = {"AR": method_preset("ar", sampling), f"SJD L={relaxed_window}": method_preset("sjd", sampling,
                                                                                       window=relaxed_window)}
    rows.update({f"MC-SJD L={w}": method_preset("mc-sjd", sampling, window=w) for w in windows})
    relaxed = method_preset("mc-sjd-relaxed", sampling, window=relaxed_window, **relaxation)
    rule = (f"delta={relaxed.delta}" if relaxed.acceptance == "lantern" else f"lam={relaxed.lam}")
    origin = "validated" if relaxation else "preset"
    rows[f"MC-SJD relaxed L={relaxed_window} ({relaxed.acceptance} k={relaxed.k}, {rule}, {origin})"] = relaxed
    rows.update({f"EAGLE {tree}, exact (drafter)": DecodeConfig(sampling=sampling, drafting=tree) for tree in eagle})
    return rows


def run_setting(pipe, configs: dict, jobs: list[list[int]], seeds: list[int], repeats: int) -> dict:
    """jobs[i] (class ids) generated with seeds[i] by every method, `repeats` times in passes of alternating
    order; a job's stats are its median repeat's (a repeat must give the same tokens). Returns per method:
    codes by job, stats."""
    out = {m: {"codes": [], "stats": []} for m in configs}
    passes = 0
    for classes, seed in tqdm(list(zip(jobs, seeds)), desc="jobs"):
        runs = {m: [] for m in configs}
        for _ in range(repeats):
            for m in (configs if passes % 2 == 0 else list(configs)[::-1]):
                runs[m].append(pipe.generate(classes, configs[m], seed=seed, batch=len(classes)))
            passes += 1
        for m, results in runs.items():
            if any(not torch.equal(r.tokens, results[0].tokens) for r in results):
                raise RuntimeError(f"{m}: repeats of seed {seed} gave different tokens")
            out[m]["codes"].append(results[0].tokens)
            by_wall = sorted((r.stats for r in results), key=lambda st: st.wall_seconds)
            out[m]["stats"].append(by_wall[(len(by_wall) - 1) // 2])
    return out


def summarise(bundle, configs: dict, runs: dict, classes: list[int], per_class: int, order: list[int]) -> list[dict]:
    """order: for each image in class-major order, its index in the concatenated codes of a method."""
    rows, ar_wall = [], sum(s.wall_seconds for s in runs["AR"]["stats"])
    for m, run in runs.items():
        stats = run["stats"]
        wall = sum(s.wall_seconds for s in stats)
        tokens, forwards = sum(s.tokens for s in stats), sum(s.target_forwards for s in stats)
        codes = torch.cat(run["codes"])[order]
        quality = evaluate(bundle, lambda _ids, _i, c=codes: c, classes=classes, n_per_class=per_class, seed=0,
                           batch_size=len(order))
        tv = [x for s in stats for x in s.token_tv]
        rows.append({"method": m, "decode": configs[m].to_dict(), "images": len(order), "wall_seconds": wall,
                     "seconds_per_image": wall / len(order), "speedup_vs_ar": ar_wall / wall,
                     "step_compression": tokens / forwards, "tokens_per_second": tokens / wall,
                     "token_tv_max": max(tv, default=0.0), "token_tv_mean": sum(tv) / len(tv) if tv else 0.0,
                     "class_accuracy": quality["generated"]["class_accuracy"],
                     "frechet_distance": quality["generated"]["frechet_distance"]})
    return rows, quality["real_train_reference"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_bundle_run_options(ap, "results/jacobi-<backend>")
    ap.add_argument("--windows", type=int, nargs="+", default=[8, 16, 32], help="MC-SJD windows")
    ap.add_argument("--relaxed-window", type=int, default=16, help="window of SJD and relaxed MC-SJD")
    ap.add_argument("--eagle", nargs="+", default=["chain-5", "lantern++-57"],
                    help="drafting of the drafter rows (exact acceptance): tree presets or dynamic")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each method per job (the median counts)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_bundle()
    classes = args.classes or list(range(bundle.target.config.num_classes))
    sampling = SamplingConfig(**bundle.default_sampling)
    configs = methods(sampling, args.windows, min(args.relaxed_window, max(args.windows)), args.eagle,
                      bundle.relaxation_defaults.get("mc-sjd-relaxed", {}))
    pipe = Pipeline(bundle.target, bundle.drafter, bundle.proximity, backend=args.backend, dtype=args.dtype)
    for dcfg in configs.values():  # prepare and warm up every static shape before timing anything
        pipe.check(dcfg)
        pipe.runner(dcfg, 1)
        pipe.runner(dcfg, len(classes))
    seeds = list(range(args.per_class))
    n = len(classes) * args.per_class
    settings = {}
    # one image at a time: job (class c, seed s); codes come out seed-major, evaluate wants class-major
    single = [(c, s) for s in seeds for c in classes]
    runs = run_setting(pipe, configs, [[c] for c, _ in single], [s for _, s in single], args.repeats)
    order = [single.index((c, s)) for c in classes for s in seeds]
    settings["single image"] = summarise(bundle, configs, runs, classes, args.per_class, order)
    # every class in one batch, once per seed: codes are (seed, class), evaluate wants class-major
    runs = run_setting(pipe, configs, [classes for _ in seeds], seeds, args.repeats)
    order = [s * len(classes) + i for i in range(len(classes)) for s in seeds]
    settings[f"{len(classes)} images per batch"] = summarise(bundle, configs, runs, classes, args.per_class, order)
    record = {"backend": args.backend, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "bundle": bundle.manifest.get("name", str(bundle.path)), "sampling": bundle.default_sampling,
              "classes": classes, "per_class": args.per_class, "images_per_setting": n, "repeats": args.repeats,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "settings": {k: {"rows": rows, "real_image_reference": ref} for k, (rows, ref) in settings.items()}}
    out = Path(args.out or ROOT / "results" / f"jacobi-{args.backend}")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_io.write_text(out.with_suffix(".json"), json.dumps(record, indent=2))
    atomic_io.write_text(out.with_suffix(".md"), markdown(record))
    print(markdown(record))


def markdown(rec: dict) -> str:
    s = rec["sampling"]
    lines = [f"Backend `{rec['backend']}` {rec['dtype']}, {rec['threads']} threads, {rec['machine']}, torch "
             f"{rec['torch']}; {len(rec['classes'])} classes x {rec['per_class']} seeds per setting; sampling CFG "
             f"{s['cfg_scale']}, temperature {s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}; "
             f"{rec['date']}. Wall = decode time (VQ decode excluded), each job's median of {rec.get('repeats', 1)} "
             f"run(s) in alternating order; step compression = tokens / target forwards "
             f"per image; token TV = TV(p_hat, p) per token (0 for exact methods)."]
    for name, setting in rec["settings"].items():
        lines += ["", f"**{name}**", "",
                  "| method | s / image | speed-up vs AR | step compression | class acc. | Frechet dist. | "
                  "max token TV |", "|---|---|---|---|---|---|---|"]
        for r in setting["rows"]:
            lines.append(f"| {r['method']} | {r['seconds_per_image']:.3f} | {r['speedup_vs_ar']:.2f}x | "
                         f"{r['step_compression']:.2f} | {r['class_accuracy']:.2f} | {r['frechet_distance']:.1f} | "
                         f"{r['token_tv_max']:.3f} |")
        lines.append(real_floor_row(setting["real_image_reference"], blanks=3))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
