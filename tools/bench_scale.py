"""LlamaGen-scale speed: AR and every method on the embedded model inflated to GPT-B / GPT-L compute shapes.

The inflated target and drafter (lantern.models.inflate) generate the embedded model's tokens, so acceptance is
the trained model's while every forward costs what LlamaGen's does. For each shape, dtype and number of images B
(one image per class 0..B-1, decoded together) and sampling setting (`--sampling`: the bundle's and LlamaGen's
class-to-image one, whole vocabulary at CFG 4.0), every method runs on every mode of --modes (eager `cpu`, compiled
`cpu-graph`; the fused step and ONNX Runtime on request) and AR also on every mode of --baseline-modes (ONNX
included), seeds in turn and methods in a rotating order, so drift of the machine falls on all alike. Each method is
reported against the fastest AR of the same run (over the modes run: named in the table) and against AR on its own
mode, with its ceiling: tokens per target forward (step compression) / verify cost ratio (the method's median verify
over AR's median step on the same mode), the speed-up a method would reach if drafting, acceptance and commit cost
nothing. Runners are prepared (compiled) before timing; the seconds are reported apart. Writes
results/scale-<cpu>.{json,md,png}, naming the CPU, commit and command.

    python tools/bench_scale.py [--shapes GPT-B GPT-L] [--images 1 4 16] [--dtypes fp32 bf16] [--sampling ...]
                                [--modes eager compiled] [--methods ar mc-sjd mc-sjd-pac:window=14:branching=2 ...]
                                [--seeds 0 1] [--threads N] [--quick]

--quick checks that the tool runs (GPT-B, eager fp32, one image, AR and MC-SJD, 4 tokens per image); its
numbers mean nothing. Timing wants a quiet machine.
"""
from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from bench_step_compression import form_config, parse_row
from fastest_ar import MODES, mode_pipeline, prepare as prepare_runner, provenance, runnable_modes
from lantern.backends.environment import cpu_model
from lantern.bundle import load_bundle
from lantern.decoding import METHODS
from lantern.models.inflate import INFLATE_SHAPES, inflate_models
from results_io import utc_now, write_results
from samplings import NAMES as SAMPLING_NAMES, sampling_settings

ROOT = Path(__file__).resolve().parents[1]
QUICK = dict(shapes=["GPT-B"], images=[1], dtypes=["fp32"], modes=["eager"], baseline_modes=["eager"],
             methods=["ar", "mc-sjd"], seeds=[0], tokens=4)


def cpu_slug(cpu: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-") or "cpu"


def phase_median(profile: dict, name: str) -> float | None:
    phase = profile["phases"].get(name)
    return phase.get("median_s") if phase and phase.get("count") else None


def setting(models, bundle, shape: str, dtype: str, n: int, modes: list[str], methods: list[str],
            seeds: list[int], tokens: int | None, ar_modes: list[str], sampling_name: str = "bundle") -> list[dict]:
    """Every (mode, method) row of one (shape, dtype, sampling, B), with speed-ups against the fastest AR over
    `modes` and `ar_modes` (modes where AR alone runs: the baseline)."""
    sampling = sampling_settings(bundle.default_sampling, [sampling_name])[sampling_name]
    # a preset, or method:name=value:... (bench_step_compression.parse_row)
    configs = {m: form_config(m, sampling, bundle.relaxation_at(sampling)) for m in methods}
    classes = [i % bundle.target.config.num_classes for i in range(n)]
    runs: dict[tuple[str, str], list[dict]] = {}
    prepare: dict[tuple[str, str], float] = {}
    pipes = {}
    plan = {mode: list(configs) for mode in modes}
    for mode in ar_modes:
        plan.setdefault(mode, ["ar"])
    for mode, names in plan.items():
        pipe = mode_pipeline(mode, models.target, models.drafter, models.proximity, dtype)
        for m in names:  # prepare (compile, export) every runner before timing anything
            prepare_runner(pipe, configs[m], classes, n)
            prepare[mode, m] = pipe.prepare_seconds[next(reversed(pipe.prepare_seconds))]
        pipes[mode] = pipe
    jobs = [(mode, m) for mode, names in plan.items() for m in names]
    for i, seed in enumerate(seeds):
        for mode, m in jobs[i % len(jobs):] + jobs[:i % len(jobs)]:  # a rotating order
            result = pipes[mode].generate(classes, configs[m], seed=seed, batch=n, tokens=tokens)
            s = result.stats.summary()
            runs.setdefault((mode, m), []).append({
                "wall_seconds": s["wall_seconds"], "step_compression": s["step_compression"],
                "mean_accepted_length": s["mean_accepted_length"], "target_forwards": s["target_forwards"],
                "verify_s": phase_median(result.profile, "verify"),
                "ar_step_s": phase_median(result.profile, "verify")})  # AR: its step is its verify
    for pipe in pipes.values():
        pipe.release()
    median = {k: statistics.median(r["wall_seconds"] for r in v) for k, v in runs.items()}
    ar_by_mode = {mode: median[mode, "ar"] for mode in plan if (mode, "ar") in median}
    fastest = min(ar_by_mode, key=ar_by_mode.get) if ar_by_mode else None
    rows = []
    for (mode, m), v in runs.items():
        ar_steps = [r["ar_step_s"] for r in runs.get((mode, "ar"), []) if r["ar_step_s"] is not None]
        ar_step = statistics.median(ar_steps) if ar_steps else None  # none where the step is not timed apart (fused)
        verify = [r["verify_s"] for r in v if r["verify_s"] is not None]
        ratio = statistics.median(verify) / ar_step if verify and ar_step else None
        compression = statistics.median(r["step_compression"] for r in v)
        rows.append({
            "shape": shape, "dtype": dtype, "sampling": sampling_name, "images": n, "mode": mode, "backend": MODES[mode][0], "method": m,
            "decode": configs[m].to_dict(), "median_s": median[mode, m], "walls": [r["wall_seconds"] for r in v],
            "fastest_ar": {"mode": fastest, "median_s": ar_by_mode[fastest]} if fastest else None,
            "speedup_vs_fastest_ar": ar_by_mode[fastest] / median[mode, m] if fastest else None,
            "speedup_vs_same_mode_ar": median[mode, "ar"] / median[mode, m] if (mode, "ar") in median else None,
            "step_compression": compression, "mean_accepted_length": statistics.median(
                r["mean_accepted_length"] for r in v),
            "verify_cost_ratio": 1.0 if m == "ar" else ratio,
            "ceiling": compression if m == "ar" else (compression / ratio if ratio else None),
            "prepare_s": prepare[mode, m]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["GPT-B", "GPT-L"], choices=sorted(INFLATE_SHAPES))
    ap.add_argument("--images", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--sampling", nargs="+", default=list(SAMPLING_NAMES), choices=SAMPLING_NAMES,
                    help="the bundle's sampling and LlamaGen's class-to-image one (whole vocabulary, CFG 4.0)")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=list(MODES))
    ap.add_argument("--baseline-modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="modes AR is also timed on for the baseline (default: all that run the dtype here)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    help="methods, each a preset or method:name=value:... (e.g. mc-sjd-pac:window=14:branching=2)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--tokens", type=int, help="tokens per image (default: the whole image)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="a check that the tool runs: " + ", ".join(
        f"{k} {v}" for k, v in QUICK.items()))
    ap.add_argument("--out", help="output stem (default results/scale-<cpu>; --quick: a temporary folder)")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if min(args.images) < 1:
        ap.error(f"--images {min(args.images)} must be >= 1")
    if "ar" not in args.methods:
        ap.error("--methods must include ar (the baseline)")
    unknown = [m for m in args.methods if parse_row(m)[0] not in METHODS]
    if unknown:
        ap.error(f"--methods {' '.join(unknown)}: unknown method; allowed: {', '.join(METHODS)} (each may take "
                 f":name=value settings)")
    if args.threads:
        torch.set_num_threads(args.threads)
    prov = provenance()
    if args.out:
        out = Path(args.out)
    elif args.quick:
        import tempfile
        out = Path(tempfile.mkdtemp(prefix="lantern-scale-quick-")) / "scale"
    else:
        out = ROOT / "results" / f"scale-{cpu_slug(cpu_model())}"  # the model name: features change no file name
    bundle = load_bundle()
    rec = {"date": utc_now(), **prov, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "seeds": args.seeds, "tokens": args.tokens, "quick": args.quick, "modes_left_out": {}, "shapes": {},
           "rows": []}
    for shape in args.shapes:
        models = inflate_models(bundle.target, bundle.drafter, bundle.proximity, shape)
        cfg = models.target.config
        rec["shapes"][shape] = {"dim": cfg.dim, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                                "vocab_size": cfg.vocab_size, "ffn_hidden": cfg.ffn_hidden,
                                "parameters": models.parameters}
        for dtype in args.dtypes:
            modes, why = runnable_modes(dtype, args.modes)
            ar_modes, why_ar = runnable_modes(dtype, args.baseline_modes)
            rec["modes_left_out"][dtype] = {**why_ar, **why}
            for name in args.sampling:
                for n in tqdm(args.images, desc=f"{shape} {dtype} {name}"):
                    rec["rows"] += setting(models, bundle, shape, dtype, n, modes, args.methods, args.seeds,
                                           args.tokens, ar_modes, name)
                    write_results(out, rec, markdown, plot)
        del models


def fmt(x, spec=".2f", suffix="") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def markdown(rec: dict) -> str:
    lines = [f"{rec['cpu']}, {rec['threads']} threads, torch {rec['torch']}, {rec['date']}; commit {rec['commit']}; "
             f"`{rec['command']}`.", "",
             "The embedded model inflated to LlamaGen's compute shapes (same tokens: acceptance is the trained "
             "model's). Median decode wall time over seeds " + str(rec["seeds"]) + (
                 f", {rec['tokens']} tokens per image" if rec["tokens"] else "") + "; B images (classes 0..B-1) "
             "decoded together. x fastest AR: over the modes of the same run (named); x own AR: AR on the same "
             "mode. Ceiling: tokens per forward / verify cost ratio (a free loop's speed-up over AR on that mode).",
             ""]
    if rec.get("quick"):
        lines += ["**--quick run: a check that the tool works; the numbers mean nothing.**", ""]
    for shape, s in rec["shapes"].items():
        lines.append(f"- {shape}: {s['n_layer']} layers x dim {s['dim']} ({s['n_head']} heads), FFN "
                     f"{s['ffn_hidden']}, vocabulary {s['vocab_size']}, {s['parameters'] / 1e6:.0f}M parameters")
    for dtype, why in rec["modes_left_out"].items():
        for mode, reason in why.items():
            lines.append(f"- {dtype}: mode {mode} not run ({reason})")
    lines += ["", "| shape | dtype | sampling | B | method | mode | s | x fastest AR (its mode) | x own AR | tokens / "
              "forward | verify cost ratio | ceiling | prepare s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        fa = r["fastest_ar"]
        lines.append(f"| {r['shape']} | {r['dtype']} | {r.get('sampling', 'bundle')} | {r['images']} | {r['method']} | "
                     f"{r['mode']} | "
                     f"{r['median_s']:.2f} | {fmt(r['speedup_vs_fastest_ar'], suffix='x')} "
                     f"({fa['mode'] if fa else '-'})"
                     f" | {fmt(r['speedup_vs_same_mode_ar'], suffix='x')} | {r['step_compression']:.2f} | "
                     f"{fmt(r['verify_cost_ratio'])} | {fmt(r['ceiling'], suffix='x')} | {r['prepare_s']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(rec: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    def panel(r):
        return r["shape"], r["dtype"], r.get("sampling", "bundle")
    panels = sorted({panel(r) for r in rec["rows"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.8), squeeze=False)
    for ax, (shape, dtype, name) in zip(axes[0], panels):
        rows = [r for r in rec["rows"] if panel(r) == (shape, dtype, name)]
        for method, mode in sorted({(r["method"], r["mode"]) for r in rows}):
            pts = sorted((r["images"], r["speedup_vs_fastest_ar"]) for r in rows
                         if (r["method"], r["mode"]) == (method, mode) and r["speedup_vs_fastest_ar"])
            if pts:
                ax.plot(*zip(*pts), marker="o", ls="-" if mode in ("compiled", "fused") else "--",
                        label=f"{method} ({mode})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape} {dtype}, {name} sampling")
        ax.set_xlabel("images decoded together (B)")
        ax.set_ylabel("speed-up over the fastest AR")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
