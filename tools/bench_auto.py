"""`--method auto` against AR and every preset method, side by side in one run, per backend and number of images.

For each backend (cpu fp32, cpu bf16, onnx fp32 by default), each sampling setting (`--sampling`: the bundle's,
and LlamaGen's class-to-image one, the whole vocabulary at CFG 4.0; tools/samplings.py) and each number of images B
(1, 4, 10; one image per class 0..B-1, decoded together), with every seed: AR, each preset as `lantern generate --method NAME` runs it (the
bundle's relaxation defaults applied), `auto` (lossless unless the bundle validates a relaxation) and
`auto --allow-relaxed`, back to back. Wall time is the decode loop's (runner preparation,
warm-up and auto's one-off calibration excluded and reported apart). A machine's speed drifts over minutes, so every
method runs the first seed, and AR, auto and the methods within 1.5x of the fastest (the ones a choice can hinge on)
run every seed `--repeats` times, in passes each in its own random order (seeded by the setting, so a rerun repeats
it; a fixed order would run the entries at its ends twice back to back and let a periodic disturbance meet the same
entries every pass), and each seed counts the median of its repeats, so a lucky fast spell counts no more than an
unlucky slow one. Reported: median wall per method over its seeds;
auto / the fastest method it could have chosen from (auto: AR, the lossless presets and the presets whose
relaxation the bundle validated, which auto may run without being asked; --allow-relaxed: every
preset), as the median over seeds of the two walls' ratio on the same seed (paired, so a slow spell of the machine
counts on both); auto's predicted speed-up over AR vs the measured one. The noise floor: AR is timed twice per seed
as two entries (`ar` and `ar again`, identical work on the same runner); their paired ratio and its spread over
seeds say how far apart two identical configurations land on this machine.
Every setting is also compared with the fastest AR on this machine (tools/fastest_ar.py: AR on every mode that runs
the dtype here -- eager, compiled, fused, ONNX -- on the same images, once per seed and repeat, in the same run),
named in the table. Writes results/auto-cpu.{json,md,png}, naming the CPU, commit and command. Timing wants a quiet
machine.

    python tools/bench_auto.py [--backends cpu:fp32 cpu:bf16 onnx:fp32] [--sampling bundle llamagen-c2i]
                               [--images 1 4 10] [--seeds 0 1 2 3 4]
                               [--repeats 3] [--baseline-modes eager compiled fused onnx] [--calibrate-machine]
                               [--quick]

--calibrate-machine times the default (auto, no backend pinned) after the one-time `lantern profile calibrate`
(every mode's compiles and exports paid and cached first), as a deployment runs it; without it, the default runs
with lantern's cache folder as found. The default is planned as `lantern serve` plans it: its one-time costs
(compiles) weighed over `--plan-images` images (the service's default, 4096), as the decode walls this tool
compares leave them out; what one `lantern generate` process pays, compiles included, is
tools/bench_first_run.py's.

--quick checks that the tool runs (cpu fp32, one image, one seed, eager baseline, 3 tokens per image, the default
planned for one image, a temporary cache and output); its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding.config import METHODS, method_preset
from lantern.backends import resolve_name
from lantern.plan.backend_choice import choose_backend
from lantern.plan.choose import choose
from lantern.serve.config import ServeConfig
from fastest_ar import ARBaseline, provenance, runnable_modes
from results_io import utc_now, write_results
from samplings import NAMES as SAMPLING_NAMES, sampling_settings

ROOT = Path(__file__).resolve().parents[1]
AUTOS = ("auto", "auto --allow-relaxed")
AR_AGAIN = "ar again"  # AR timed a second time per seed: the noise floor
SCREEN = 1.5  # after the first seed, only methods within this factor of the fastest run the other seeds


def setting(bundle, backend: str, dtype: str, n: int, seeds: list[int], repeats: int,
            baseline_modes: list[str] | None = None, tokens: int | None = None,
            calibrate_machine: bool = False, sampling_name: str = "bundle",
            plan_images: int = ServeConfig.plan_images) -> dict:
    pipe = Pipeline.from_bundle(bundle, backend=backend, dtype=dtype)  # the bundle's relaxations and records
    sampling = sampling_settings(bundle.default_sampling, [sampling_name])[sampling_name]
    classes = list(range(n))
    t0 = time.perf_counter()
    # `auto` last: a choice keeps the runner its plan was timed on and frees the others. Each measures whatever it
    # lacks (measure_all), as auto decides once a machine has learned (lantern.plan.deciding)
    choices = {name: choose(pipe, n, sampling, allow_relaxed=name != "auto", progress=False, classes=classes,
                            measure_all=True) for name in AUTOS[::-1]}
    planning = time.perf_counter() - t0
    validated = bundle.relaxation_at(sampling)  # the relaxations validated at this sampling
    configs = {m: (method_preset(m, sampling, **validated.get(m, {})), n) for m in METHODS}
    configs[AR_AGAIN] = configs["ar"]  # the noise floor: identical work, timed as a method of its own
    configs.update({name: (c.decode, c.width) for name, c in choices.items()})
    for dcfg, width in configs.values():  # prepare and warm every runner before timing
        pipe.generate(classes, dcfg, batch=width, tokens=2, allow_relaxed=True)
    modes, left_out = runnable_modes(dtype, baseline_modes)
    baseline = ARBaseline(bundle.target, bundle.drafter, bundle.proximity, dtype, sampling, modes, width=n)
    runs = {m: {} for m in configs}  # method -> seed -> the walls of its repeats
    # auto with no backend pinned (what `lantern generate` runs): it may choose another mode; only where this
    # setting's backend is the machine's default one
    anywhere = None
    if backend == resolve_name("auto"):
        common = dict(progress=False, classes=classes, dtype=dtype, default=pipe)
        machine_s = None
        if calibrate_machine:  # what `lantern profile calibrate --images n` does once per machine
            t1 = time.perf_counter()
            choose_backend(pipe.sibling, n, sampling, calibrate_all=True, **common)
            machine_s = time.perf_counter() - t1
        served = {**common, "classes": [classes[i % n] for i in range(plan_images)]}  # these images, over and over
        anywhere = choose_backend(pipe.sibling, plan_images, sampling, batch=n, **served)  # as a service plans
        anywhere.pipeline.generate(classes, anywhere.decode, batch=anywhere.width, tokens=2, allow_relaxed=True)
    any_walls: dict[int, list[float]] = {}

    def run(names: list[str], seed: int) -> None:
        for m in names:
            dcfg, width = configs[m]
            wall = pipe.generate(classes, dcfg, seed=seed, batch=width, tokens=tokens,
                                 allow_relaxed=True).stats.wall_seconds
            runs[m].setdefault(seed, []).append(wall)
        baseline.time(classes, seed, tokens=tokens)
        if anywhere is not None:
            result = anywhere.pipeline.generate(classes, anywhere.decode, seed=seed, batch=anywhere.width,
                                                tokens=tokens, allow_relaxed=True)
            any_walls.setdefault(seed, []).append(result.stats.wall_seconds)

    run(list(configs), seeds[0])  # the screen: every method once
    best = min(r[seeds[0]][0] for r in runs.values())
    contenders = [m for m in configs if runs[m][seeds[0]][0] <= SCREEN * best or m in ("ar", AR_AGAIN, *AUTOS)]
    order = random.Random(f"{backend} {dtype} {n}" + ("" if sampling_name == "bundle" else f" {sampling_name}"))
    for seed in seeds:
        for _ in range(repeats - (seed == seeds[0])):  # the screen was the first seed's first pass
            run(order.sample(contenders, len(contenders)), seed)
    # this machine has fast spells and slow ones: a seed's wall is the median of its repeats
    walls = {m: [statistics.median(r[s]) for s in seeds if s in r] for m, r in runs.items()}
    median = {m: statistics.median(w) for m, w in walls.items()}
    # auto may run what is lossless and what the bundle validated; --allow-relaxed may run every preset
    allowed = [m for m in METHODS if configs[m][0].acceptance == "exact" or m in validated]
    out = {"backend": backend, "dtype": dtype, "images": n, "sampling": sampling_name,
           "sampling_config": dataclasses.asdict(sampling), "walls": walls, "runs": runs, "median_s": median,
           "speedup_vs_ar": {m: median["ar"] / median[m] for m in median}, "planning_s": planning,
           "auto_presets": allowed, "choices": {name: c.to_dict() for name, c in choices.items()},
           "noise_floor": paired(walls[AR_AGAIN], walls["ar"])}
    by_mode = {m: statistics.median(w) for m, w in baseline.walls.items()}
    fastest = min(by_mode, key=by_mode.get)
    out["fastest_ar"] = {"mode": fastest, "median_s": by_mode[fastest], "median_by_mode": by_mode,
                         "prepare_s": baseline.prepare_s, "modes_left_out": left_out}
    out["speedup_vs_fastest_ar"] = {m: by_mode[fastest] / median[m] for m in median}
    if anywhere is not None:
        any_median = statistics.median(statistics.median(w) for w in any_walls.values())
        out["auto_any_mode"] = {"choice": anywhere.to_dict(), "walls": any_walls, "median_s": any_median,
                                "speedup_vs_fastest_ar": by_mode[fastest] / any_median,
                                "machine_calibrated": calibrate_machine, "machine_calibration_s": machine_s,
                                "plan_images": plan_images}
    out["auto_vs_fastest"] = versus_fastest(out, configs, {"auto": allowed, "auto --allow-relaxed": list(METHODS)})
    return out


def versus_fastest(row: dict, configs: dict, pools: dict) -> dict:
    """Each auto entry against the fastest preset of its pool (by median wall), paired over seeds."""
    median, walls, out = row["median_s"], row["walls"], {}
    for name, pool in pools.items():
        fastest = min(pool, key=median.get)
        predicted = row["choices"][name]["predicted_speedup"]
        out[name] = {"fastest": fastest, "same_configuration": configs[name] == configs[fastest],
                     "median_ratio": median[name] / median[fastest], **paired(walls[name], walls[fastest]),
                     "predicted_speedup": predicted, "measured_speedup": median["ar"] / median[name],
                     "prediction_error": predicted / (median["ar"] / median[name]) - 1}
    return out


def paired(a: list[float], b: list[float]) -> dict:
    """Walls of two entries on the same seeds -> the median of their per-seed ratios a/b and its range."""
    ratios = [x / y for x, y in zip(a, b)]
    return {"ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)], "seeds": len(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", nargs="+", default=["cpu:fp32", "cpu:bf16", "onnx:fp32"], help="BACKEND:DTYPE")
    ap.add_argument("--images", type=int, nargs="+", default=[1, 4, 10])
    ap.add_argument("--sampling", nargs="+", default=list(SAMPLING_NAMES), choices=SAMPLING_NAMES,
                    help="sampling settings, side by side: the bundle's and LlamaGen's class-to-image one (whole "
                         "vocabulary, CFG 4.0)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--repeats", type=int, default=3, help="runs per method and seed (their median counts)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline-modes", nargs="+", help="modes whose AR is the baseline (default: every mode that "
                                                        "runs the dtype here: eager, compiled, onnx)")
    ap.add_argument("--calibrate-machine", action="store_true",
                    help="before timing auto with no backend pinned, calibrate every mode as `lantern profile "
                         "calibrate --images B` does once per machine (compiles and exports included), so the "
                         "default is timed as it runs after that one-time setup, not with the cache as found")
    ap.add_argument("--plan-images", type=int, default=ServeConfig.plan_images,
                    help="the images the default's one-time costs are weighed over, as `lantern serve "
                         "--plan-images` (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="a check that the tool runs; its numbers mean nothing")
    ap.add_argument("--out", help="output stem (default results/auto-cpu; --quick: a temporary folder)")
    args = ap.parse_args()
    args.tokens = None
    if args.quick:
        import os
        import tempfile
        tmp = Path(tempfile.mkdtemp(prefix="lantern-auto-quick-"))
        os.environ["LANTERN_CACHE_DIR"] = str(tmp / "cache")
        args.backends, args.images, args.seeds, args.repeats = ["cpu:fp32"], [1], [0], 1
        args.baseline_modes, args.tokens, args.out = ["eager"], 3, args.out or str(tmp / "auto")
        args.plan_images = 1  # a service's planning calibrates every mode in full: minutes
    args.out = args.out or str(ROOT / "results" / "auto-cpu")
    for name in ("repeats", "threads", "plan_images"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if min(args.images) < 1:
        ap.error(f"--images {min(args.images)} must be >= 1")
    for spec in args.backends:
        if spec.count(":") != 1:
            ap.error(f"--backends {spec!r} must be BACKEND:DTYPE, e.g. cpu:fp32")
    torch.set_num_threads(args.threads)
    bundle = load_bundle()
    rows = []
    for spec in tqdm(args.backends, desc="backends"):
        backend, dtype = spec.split(":")
        for name in args.sampling:
            for n in args.images:
                rows.append(setting(bundle, backend, dtype, n, args.seeds, args.repeats, args.baseline_modes,
                                    args.tokens, args.calibrate_machine, name, args.plan_images))
                write_results(args.out, record(args, rows), markdown, plot)


def record(args, rows: list[dict]) -> dict:
    return {"date": utc_now(), **provenance(), "threads": args.threads, "seeds": args.seeds,
            "repeats": args.repeats, "quick": args.quick, "rows": rows}


def markdown(rec: dict) -> str:
    repeats = rec.get("repeats", 1)
    lines = [f"Embedded model, {rec['cpu']}, {rec['threads']} threads, {rec['date']}; median decode wall time over "
             f"seeds {rec['seeds']}, each seed the median of {repeats} run(s) (one image per class 0..B-1, decoded "
             f"together; a method more than {SCREEN}x slower than the fastest on the first run ran once, marked *). "
             "x = speed-up over AR at the same B. Noise floor: `ar again` / `ar`, identical work on the same runner, "
             "median of per-seed ratios [range]. auto / fastest: auto's wall over the fastest method it could choose "
             "from (auto: AR, the lossless presets and the presets the bundle validated a relaxation for; "
             "--allow-relaxed: every preset), median of per-seed ratios [range]; 'same config' when auto ran exactly "
             "that method's configuration (same plan, same runner), where any gap is noise. "
             "Calibration: seconds timing plans, + seconds preparing runners (exporting graphs), both once per "
             "machine, backend, dtype and B. Fastest AR: AR on every mode that runs the dtype here, on the same "
             "images in the same run (median over seeds and repeats); x fastest AR: its wall / the entry's.", ""]
    if rec.get("commit"):
        lines[-1:-1] = [f"Commit {rec['commit']}; `{rec['command']}`." + (
            " **--quick: a check that the tool runs; the numbers mean nothing.**" if rec.get("quick") else "")]
    methods = [*(m for m in rec["rows"][0]["median_s"] if m not in AUTOS), *AUTOS]
    lines += ["| backend | sampling | B | " + " | ".join(methods) + " | noise floor | auto chose | auto / fastest | predicted vs "
              "measured speed-up (auto) | auto --allow-relaxed chose | its / fastest | predicted vs measured | "
              "calibration (s) | fastest AR (mode) | auto x fastest AR | auto, no backend pinned: chose | its x "
              "fastest AR (predicted) |", "|---|---|---|" + "---|" * (len(methods) + 12)]
    for r in rec["rows"]:
        cells = [f"{r['median_s'][m]:.2f} s ({r['speedup_vs_ar'][m]:.2f}x){'*' if len(r['walls'][m]) == 1 else ''}"
                 for m in methods]
        cells.append(ratio_text(r["noise_floor"]))
        for name in AUTOS:
            c, v = r["choices"][name], r["auto_vs_fastest"][name]
            same = ", same config" if v["same_configuration"] else ""
            cells += [f"{c['plan']} (B={c['batch']})", f"{ratio_text(v)} (fastest: {v['fastest']}{same})",
                      f"{v['predicted_speedup']:.2f} vs {v['measured_speedup']:.2f}"]
        timing = sum(r["choices"][name]["calibration_seconds"] for name in AUTOS)
        prepare = sum(r["choices"][name]["calibration_prepare_seconds"] for name in AUTOS)
        fa = r.get("fastest_ar")
        versus = (f" | {fa['median_s']:.2f} s ({fa['mode']}) | {r['speedup_vs_fastest_ar']['auto']:.2f}x" if fa
                  else " | - | -")
        a = r.get("auto_any_mode")
        setup = (f" (after `lantern profile calibrate`: {a['machine_calibration_s']:.0f} s once)"
                 if a and a.get("machine_calibrated") else " (cache as found)" if a else "")
        setup += f", weighed over {a['plan_images']} images" if a and "plan_images" in a else ""
        versus += (f" | {a['choice']['plan']} on {a['choice']['backend']} ({a['choice']['mode']}){setup} | "
                   f"{a['speedup_vs_fastest_ar']:.2f}x ({a['choice']['speedup_over_fastest_ar']:.2f}x)" if a
                   else " | - | -")
        lines.append(f"| {r['backend']} {r['dtype']} | {r.get('sampling', 'bundle')} | {r['images']} | "
                     + " | ".join(cells) +
                     f" | {timing:.0f} + {prepare:.0f}{versus} |")
    return "\n".join(lines) + "\n"


def ratio_text(v: dict) -> str:
    lo, hi = v["ratio_range"]
    return f"{v['ratio']:.3f} [{lo:.2f}-{hi:.2f}]"


def plot(rec: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["backend"], r["dtype"], r.get("sampling", "bundle")) for r in rec["rows"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (backend, dtype, name) in zip(axes[0], panels):
        rows = [r for r in rec["rows"] if (r["backend"], r["dtype"], r.get("sampling", "bundle")) == (backend, dtype, name)]
        xs = [r["images"] for r in rows]
        for m in [*(m for m in rows[0]["median_s"] if m not in (*AUTOS, AR_AGAIN)), *AUTOS]:
            style = dict(lw=2.5, color="k") if m == "auto" else dict(lw=1, ls="--" if m.startswith("auto") else "-")
            ax.plot(xs, [r["speedup_vs_ar"][m] for r in rows], marker="o", label=m, **style)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{backend} {dtype}, {name} sampling")
        ax.set_xlabel("images decoded together (B)")
        ax.set_ylabel("speed-up over AR")
        ax.set_xticks(xs)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
