"""Where a decode step's time goes, one image at a time on the embedded model: AR, MC-SJD and relaxed MC-SJD.

Per method, over the bundle's classes (one image each, seeds 0..per-class-1):
- the real decode: wall per step, split into the forward (the runner's verify phase, sampling warp included),
  the acceptance phase and the rest of the loop (drafts, masks, bookkeeping); and the model alone (the
  runner's verify call, without the warp);
- the ceiling: AR's wall over the method's model time alone, the speed-up a loop that took no time would reach;
- the loop alone: the same decode with the runner's verify answering every step with one cached output, so
  the time left is the loop's own work (sampling, acceptance, redraws, masks), none of the model's;
- Jacobi rows: acceptance by window depth (how often the d-th draft was kept, given the ones before were), and
  how many steps' first rejection was of a draft outside the target's support (its top-k): a relaxed rule only
  moves mass among that support, so it can never keep such a draft (read in an untimed pass).
Speed-up = AR's decode wall / the method's, summed over the same images. The methods take turns image by image
(in alternating order), so a slow spell of the machine falls on all of them alike; each image counts its median of
`--repeats` runs. Writes results/step-anatomy-<backend>-<dtype>.
Timing wants a quiet machine.

    python tools/bench_step_anatomy.py --dtype bf16 --threads 2 [--window 16] [--repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import platform
import time
from collections import Counter
from pathlib import Path

import torch

from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding import SamplingConfig, method_preset
from lantern.decoding.sampling import target_support
from results_io import add_bundle_run_options, utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def watching_verify(runner, watch):
    """Route this runner instance's verify calls through `watch(verify, *args)`, `verify` being what they reached
    before (another watch's, when nested); restored on exit."""
    before, own = runner.verify, runner.__dict__.get("verify")
    runner.verify = lambda *args: watch(before, *args)
    try:
        yield
    finally:
        if own is None:
            del runner.verify
        else:
            runner.verify = own


def decode_job(pipe, dcfg, cls: int, seed: int) -> dict:
    """One image: wall, steps, phase seconds, model seconds (the runner's verify calls), depth counts."""
    model = [0.0]

    def timed(real, *args):
        start = time.perf_counter()
        out = real(*args)
        model[0] += time.perf_counter() - start
        return out
    with watching_verify(pipe.runner(dcfg, 1), timed):
        st = pipe.generate([cls], dcfg, seed=seed, batch=1).stats
    tried, kept = Counter(), Counter()
    for image in st.images:
        tried.update(image.depth_tried)
        kept.update(image.depth_accepted)
    return {"wall": st.wall_seconds, "steps": st.target_forwards - 1,  # the prefill is not a step
            "phases": Counter(st.phase_seconds), "model": model[0], "tried": tried, "kept": kept}


def summed(runs: list[dict]) -> dict:
    """Images' runs -> their totals, and acceptance by depth over all of them."""
    total = {"wall": 0.0, "steps": 0, "model": 0.0, "phases": Counter(), "tried": Counter(), "kept": Counter()}
    for run in runs:
        for key in ("wall", "steps", "model"):
            total[key] += run[key]
        for key in ("phases", "tried", "kept"):
            total[key].update(run[key])
    total["depth"] = {d: total["kept"][d] / total["tried"][d] for d in sorted(total["tried"])}
    return total


def decode_pass(pipe, dcfg, jobs: list[tuple[int, int]]) -> dict:
    """Every job (class, seed) once, summed."""
    return summed([decode_job(pipe, dcfg, cls, seed) for cls, seed in jobs])


def loop_alone(pipe, dcfg, jobs: list[tuple[int, int]]) -> float:
    """Seconds per step of the decode loop with the forward replaced by one cached output."""
    cached = []

    def replay(real, *args):
        if not cached:
            cached.append(real(*args))
        return cached[0]
    with watching_verify(pipe.runner(dcfg, 1), replay):
        p = decode_pass(pipe, dcfg, jobs)
    return p["wall"] / p["steps"]


def first_rejections(pipe, dcfg, jobs: list[tuple[int, int]]) -> dict:
    """Jacobi windows, one image per call: of the steps that ended in a rejection, how many rejected a draft
    outside the target's support (warped top-k). Read from consecutive verify calls: the next root's position
    says how many drafts m were kept, so draft m + 1 was tested against the support after node m."""
    counts = {"rejections": 0, "outside_support": 0}
    previous = {}

    def read(real, tokens, positions, slots, mask):
        out = real(tokens, positions, slots, mask)  # tokens, positions (R, L+1): row 0 is the image's own
        root = int(positions[0, 0])
        if previous:
            m = root - previous["root"] - 1
            if m < tokens.shape[1] - 1:
                counts["rejections"] += 1
                inside = (previous["support"][m] == previous["tokens"][m + 1]).any()
                counts["outside_support"] += int(not bool(inside))
        previous.update(root=root, tokens=tokens[0].clone(),
                        support=target_support(out.logits, dcfg.sampling).ids[0])  # (L+1, K)
        return out
    for cls, seed in jobs:
        previous.clear()
        with watching_verify(pipe.runner(dcfg, 1), read):
            pipe.generate([cls], dcfg, seed=seed, batch=1)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_bundle_run_options(ap, "results/step-anatomy-<backend>-<dtype>")
    ap.add_argument("--window", type=int, default=16, help="Jacobi window L")
    ap.add_argument("--repeats", type=int, default=3, help="runs per image and method (the median counts)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} must be >= 1")
    if args.per_class < 1:
        ap.error(f"--per-class {args.per_class} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_bundle()
    sampling = SamplingConfig(**bundle.default_sampling)
    relaxation = bundle.relaxation_defaults.get("mc-sjd-relaxed", {})
    configs = {"AR": method_preset("ar", sampling),
               f"MC-SJD L={args.window}": method_preset("mc-sjd", sampling, window=args.window),
               f"MC-SJD relaxed L={args.window}": method_preset("mc-sjd-relaxed", sampling, window=args.window,
                                                                 **relaxation)}
    pipe = Pipeline(bundle.target, bundle.drafter, bundle.proximity, backend=args.backend, dtype=args.dtype)
    for dcfg in configs.values():
        pipe.check(dcfg)
        pipe.runner(dcfg, 1)
    classes = args.classes or list(range(bundle.target.config.num_classes))
    jobs = [(c, s) for s in range(args.per_class) for c in classes]
    runs = {m: {job: [] for job in jobs} for m in configs}
    order = list(configs)
    for r in range(args.repeats):
        for i, job in enumerate(jobs):  # the methods take turns image by image, in alternating order
            for m in (order if (r + i) % 2 == 0 else order[::-1]):
                runs[m][job].append(decode_job(pipe, configs[m], *job))
        print(f"round {r + 1}/{args.repeats}: " + ", ".join(
            f"{m} {sum(by_job[-1]['wall'] for by_job in runs[m].values()):.2f} s" for m in order), flush=True)
    rows = []
    for m in order:
        mid = summed([sorted(by_job, key=lambda run: run["wall"])[(len(by_job) - 1) // 2]
                      for by_job in runs[m].values()])  # each image's median run
        steps, ph = mid["steps"], mid["phases"]
        forward = ph.get("verify", ph.get("decode", 0.0))
        rest = mid["wall"] - ph.get("prefill", 0.0) - forward - ph.get("accept", 0.0)
        rows.append({"method": m, "wall_s": mid["wall"], "steps": steps, "tokens_per_step": len(jobs) *
                     bundle.target.config.block_size / (steps + len(jobs)), "ms_per_step": 1e3 * mid["wall"] / steps,
                     "forward_ms": 1e3 * forward / steps, "accept_ms": 1e3 * ph.get("accept", 0.0) / steps,
                     "rest_ms": 1e3 * rest / steps, "model_ms": 1e3 * mid["model"] / steps,
                     "model_s": mid["model"], "loop_alone_ms": 1e3 * loop_alone(pipe, configs[m], jobs),
                     "acceptance_by_depth": mid["depth"],
                     "first_rejections": first_rejections(pipe, configs[m], jobs) if mid["depth"] else None})
    for row in rows:
        row["speedup"] = rows[0]["wall_s"] / row["wall_s"]
        row["ceiling"] = rows[0]["wall_s"] / row["model_s"]
    record = {"backend": args.backend, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "images": len(jobs), "repeats": args.repeats, "window": args.window,
              "sampling": bundle.default_sampling, "date": utc_now(), "rows": rows}
    write_results(args.out or ROOT / "results" / f"step-anatomy-{args.backend}-{args.dtype}", record,
                  markdown)


def markdown(rec: dict) -> str:
    head = (f"Backend `{rec['backend']}` {rec['dtype']}, {rec['threads']} threads, {rec['machine']}, torch "
            f"{rec['torch']}; {rec['images']} images one at a time, the methods taking turns image by image, each "
            f"image's median of {rec['repeats']} runs; "
            f"{rec['date']}. Per step: the real decode split into forward (verify phase, sampling warp "
            f"included), acceptance and the rest of the loop; 'model' = the runner's verify call alone (no warp); "
            f"'ceiling' = AR's wall over the method's model time: the speed-up of a loop that took no time; "
            f"'loop alone' = the same decode with the forward answered from a cache.\n\n")
    lines = ["| method | speed-up vs AR | ceiling | tokens / forward | ms / step | forward | model | acceptance | "
             "rest | loop alone |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        lines.append(f"| {r['method']} | {r['speedup']:.2f}x | {r['ceiling']:.2f}x | {r['tokens_per_step']:.2f} | "
                     f"{r['ms_per_step']:.2f} | {r['forward_ms']:.2f} | {r['model_ms']:.2f} | {r['accept_ms']:.2f} | "
                     f"{r['rest_ms']:.2f} | {r['loop_alone_ms']:.3f} |")
    depth = ["", "Acceptance by window depth (the d-th draft kept, given the ones before it were):", ""]
    for r in rec["rows"]:
        if r["acceptance_by_depth"]:
            depth.append(f"- {r['method']}: " + ", ".join(f"{d}: {a:.2f}" for d, a in
                                                          r["acceptance_by_depth"].items()))
    outside = ["", "Steps whose first rejection was of a draft outside the target's support (its top-k), which no "
               "relaxation of the target on that support can keep:", ""]
    for r in rec["rows"]:
        f = r.get("first_rejections")
        if f and f["rejections"]:
            outside.append(f"- {r['method']}: {f['outside_support']} of {f['rejections']} "
                           f"({f['outside_support'] / f['rejections']:.0%})")
    return head + "\n".join(lines + depth + outside) + "\n"


if __name__ == "__main__":
    main()
