"""`lantern profile run | compare | calibrate | tune` (the profile suite, lantern.profile), and what
`lantern generate --profile NAME` reads of a profile (`apply_profile`, `profile_costs`).

Exit codes (also the "exit_code" field of the --json object): 0 every case ok; 1 some case failed (each
is recorded in the results file with its error) or an internal error; 2 bad input (unknown profile, bad
value, incompatible results file); 3 the profile's backend is unavailable here (recorded as a failed case).
No command ever prompts.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from lantern.api import DEFAULT_BATCH, Pipeline
from lantern.cli.parsing import number
from lantern.cli.sampling_flags import add_sampling_options, sampling_from_args
from lantern.decoding.config import method_preset
from lantern.decoding.trees import TREE_PRESETS
from lantern.exit_codes import EXIT_FAILED_CASES, EXIT_OK, EXIT_UNAVAILABLE
from lantern.extras import available, install_hint, require
from lantern.files.atomic_io import check_writable
from lantern.files.reading import UnreadableFile
from lantern.bundle import load_bundle
from lantern.plan.backend_choice import choose_backend
from lantern.plan.calibration import ProfileCosts
from lantern.profile import measure
from lantern.profile.hardware import load_profile, profile_from_dict, write_tuned
from lantern.profile.report import compare
from lantern.profile.schema import SchemaError, calibration_entries, load_results, save_results
from lantern.profile.suite import STATIC_TREE_METHODS, Suite, default_results_path
from lantern.profile.tune import tune_results


def add_arguments(prof) -> None:
    sub = prof.add_subparsers(dest="profile_command", required=True)

    r = sub.add_parser("run", help="measure one hardware profile into a results file (resumable)")
    r.add_argument("--profile", help="profile NAME (a shipped one, or NAME.toml on the search path: docs/profiles.md) "
                                     "or a .toml FILE (default: built-in defaults on the selected backend)")
    r.add_argument("--backend", help="override the profile's backend (default: the profile's, else "
                                     "$LANTERN_BACKEND, else auto)")
    r.add_argument("--model", help="auto | bundle | bundle:PATH | random:PRESET (default: the profile's)")
    r.add_argument("--out", help="results file (default: results/<profile>.json)")
    r.add_argument("--fresh", action="store_true", help="start over instead of resuming the results file")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=cmd_run, show=print_run)

    c = sub.add_parser("compare", help="merge results files into report.md and PNG plots")
    c.add_argument("files", nargs="+", help="results files (any machines and backends)")
    c.add_argument("--out", default="results/report", help="folder for report.md and the plots")
    shown = c.add_mutually_exclusive_group()
    shown.add_argument("--plots", action="store_true", help="require the PNG plots: exit 2 if matplotlib is missing "
                                                            "(default: plots when matplotlib is installed)")
    shown.add_argument("--no-plots", action="store_true", help="Markdown only")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_compare, show=print_compare)

    k = sub.add_parser("calibrate", help="calibrate `--method auto` on every mode this machine runs (eager, "
                                         "compiled, onnx), so auto can weigh them for any request")
    k.add_argument("--model", help="bundle folder (default: the embedded model)")
    k.add_argument("--dtype", help="fp32 | bf16 (default: the default backend's preferred)")
    k.add_argument("--images", type=number(int, 1), default=1, help="images per request to calibrate for, >= 1 "
                                                                  "(default 1)")
    k.add_argument("--batch", type=number(int, 1), help="images per step (default: as auto chooses)")
    k.add_argument("--allow-relaxed", action="store_true", help="calibrate relaxed plans too")
    add_sampling_options(k.add_argument_group("the sampling to measure at (acceptance records, step costs)"))
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_calibrate, show=print_calibrate)

    t = sub.add_parser("tune", help="choose a static tree per batch size for a profile from its measurements and "
                                    "write them into the profile")
    t.add_argument("--profile", required=True, help="profile NAME or .toml FILE (its [tuned] table is rewritten)")
    t.add_argument("--results", help="results file (default: results/<profile>.json)")
    t.add_argument("--max-nodes", type=number(int, 2),
                   help="largest tree size N, root included, >= 2 (default: the largest measured at each batch "
                        "size)")
    t.add_argument("--dry-run", action="store_true", help="choose and print, write nothing")
    t.add_argument("--measure", action="store_true", help="then, at each tuned batch size, time its tree against "
                                                          "the default lantern++-57 tree side by side, in one run")
    t.add_argument("--repeats", type=number(int, 1),
                   help="passes of --measure, >= 1 (default: the profile's generation_repeats)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=cmd_tune, show=print_tune)


def _profile(spec):
    return load_profile(spec) if spec else profile_from_dict({"name": "default"})


def cmd_run(args) -> dict:
    suite = Suite(_profile(args.profile), backend=args.backend, model=args.model,
                  out=Path(args.out) if args.out else None, fresh=args.fresh, progress=not args.no_progress)
    check_writable(suite.out, "results file", folder=False)
    out = suite.run()
    out["exit_code"] = (EXIT_UNAVAILABLE if not out["available"] else EXIT_FAILED_CASES if out["failed"] else EXIT_OK)
    return out


def print_run(out: dict) -> None:
    if not out["available"]:
        print(f"profile {out['profile']}: backend unavailable: {out['reason']}")
    else:
        print(f"profile {out['profile']} on {out['backend']} ({out['model']}): {out['planned']} cases, "
              f"{out['ran']} run, {out['resumed']} resumed, {len(out['failed'])} failed")
        for case, err in out["errors"].items():
            print(f"  failed {case}: {err}")
    print(f"results: {out['results']}")


def cmd_calibrate(args) -> dict:
    """Every mode's calibration for the request size, measured now (compiles and exports included), cached where
    `--method auto` reads it; prints the choice it would make."""
    bundle = load_bundle(args.model)
    choice = choose_backend(lambda name, dtype, **options: Pipeline.from_bundle(bundle, backend=name, dtype=dtype,
                                                                                **options), args.images,
                            sampling_from_args(args, bundle), batch=args.batch,
                            allow_relaxed=args.allow_relaxed, dtype=args.dtype, calibrate_all=True)
    return {**choice.to_dict(), "exit_code": EXIT_OK}


def print_calibrate(out: dict) -> None:
    for row in out["backends"]:
        detail = (f"AR {row['ar_seconds']:.2f} s, best {row['best_plan']} {row['best_seconds']:.2f} s"
                  if row["status"] == "weighed" else row["status"])
        print(f"{row['backend']} ({row['mode']}): {detail}")
    print(f"auto would choose {out['why']}")


def cmd_compare(args) -> dict:
    if args.plots:
        require("matplotlib", "lantern profile compare --plots")
    with_plots = not args.no_plots and available("matplotlib")
    check_writable(Path(args.out), "--out", folder=True)
    out = compare(args.files, args.out, with_plots=with_plots)
    out["plots_skipped"] = None if with_plots or args.no_plots else install_hint("matplotlib")
    return out


def print_compare(out: dict) -> None:
    print(f"report: {out['report']}  ({len(out['runs'])} runs)")
    if out["plots_skipped"]:
        print(f"plots skipped: {out['plots_skipped']}")
    for name, path in out["plots"].items():
        print(f"plot {name}: {path}")


def cmd_tune(args) -> dict:
    profile = _profile(args.profile)
    results = Path(args.results) if args.results else default_results_path(profile)
    data = load_results(results)
    if not data["backend"].get("available"):
        raise ValueError(f"{results} holds no measurements: its backend was unavailable "
                         f"({data['backend'].get('reason')})")
    tuned = tune_results(data, TREE_PRESETS, args.max_nodes)
    out = {"profile": profile.name, "results": str(results),
           "batches": {b: tuned_summary(t) for b, t in tuned["batches"].items()},
           "written": None, "measured": None, "exit_code": EXIT_OK}
    if args.dry_run:
        return out
    if profile.path is None:
        raise ValueError("tune writes into a profile file: pass --profile NAME or FILE")
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    common = {"results": results.name, "model": data["model"].get("name"), "backend": data["backend"]["name"],
              "tuned_at": stamp}
    trees = {b: ({"N": t["choice"]["N"], "depth": t["choice"]["depth"],
                  "predicted_tau": round(t["choice"]["tau"], 4),
                  "predicted_step_ms": round(t["choice"]["step_s"] * 1e3, 3)}, t["choice"]["paths"])
             for b, t in tuned["batches"].items()}
    files = write_tuned(profile.path, common, trees)
    data["tune"] = {"tuned_at": stamp, "acceptance_rates": tuned["acceptance_rates"],
                    "batches": {b: {**t, "choice": {**t["choice"], "paths": [list(p) for p in t["choice"]["paths"]]},
                                    "tree_file": str(files[b])} for b, t in tuned["batches"].items()}}
    out["written"] = {"profile": str(profile.path), "tree_files": {b: str(f) for b, f in files.items()}}
    if args.measure:
        measured = measure_tuned(profile.path, data, args.repeats, list(files))
        for b, m in measured.items():
            data["tune"]["batches"][b]["measured"] = m
        out["measured"] = measured
    save_results(data, results)
    return out


def tuned_summary(tuned: dict) -> dict:
    """What `tune` prints of one batch size's choice, and of the presets under the same model."""
    choice = tuned["choice"]
    return {"tree": [list(p) for p in choice["paths"]], "N": choice["N"], "depth": choice["depth"],
            "predicted_tau": choice["tau"], "predicted_step_ms": choice["step_s"] * 1e3,
            "predicted_speedup_vs_ar": choice["predicted_speedup_vs_ar"],
            "presets": {k: {"N": v["N"], "tau": v["tau"], "step_ms": v["step_s"] * 1e3,
                            "speedup_vs_ar": v["predicted_speedup_vs_ar"]} for k, v in tuned["presets"].items()},
            "host_overhead_ms": [tuned["cost_model"]["host_a_s"] * 1e3,
                                 tuned["cost_model"]["host_b_s_per_node"] * 1e3]}


def measure_tuned(profile_path: Path, data: dict, repeats, batches: list[int]) -> dict[int, dict]:
    """At each batch size, its tuned tree against the default 57-node tree, interleaved in one run on the
    profile's backend and the results file's model (the profile's classes cycled to that many images)."""

    profile = load_profile(str(profile_path))  # re-read: it now names the tuned trees
    suite = Suite(profile, backend=data["backend"]["name"], model=data["model"]["name"])
    suite.setup_backend()
    suite.setup_models()
    pipe = suite.make_pipe()
    reps = repeats or profile.generation_repeats
    measured = {}
    for b in batches:
        dcfgs = {"lantern++-57": method_preset("lantern++", suite.sampling),
                 "tuned": method_preset("lantern++", suite.sampling, drafting=str(profile.tuned_tree_file(b)))}
        classes = profile.classes_at(b)
        runs = measure.side_by_side(pipe, dcfgs, classes, profile.seed, profile.generation_warmup, reps)
        ratio = runs["tuned"]["wall"]["median_s"] / runs["lantern++-57"]["wall"]["median_s"]
        measured[b] = {"runs": runs, "classes": classes, "repeats": reps, "tuned_over_default": ratio}
    return measured


def print_tune(out: dict) -> None:
    for b, t in out["batches"].items():
        sp = t["predicted_speedup_vs_ar"]
        print(f"profile {out['profile']}, batch {b}: tree N={t['N']} depth {t['depth']}, "
              f"predicted tau {t['predicted_tau']:.2f}, "
              f"step {t['predicted_step_ms']:.1f} ms" + (f", speed-up vs AR {sp:.2f}x" if sp else ""))
        for name, p in t["presets"].items():
            sp = p["speedup_vs_ar"]
            print(f"  preset {name:<14} N={p['N']:<4} tau {p['tau']:.2f}  step {p['step_ms']:.1f} ms"
                  + (f"  speed-up vs AR {sp:.2f}x" if sp else ""))
        m = (out["measured"] or {}).get(b)
        if m:
            for name, r in m["runs"].items():
                print(f"  measured {name:<14} {r['wall']['median_s']:.2f} s (tau {r['tau']:.2f})")
            print(f"  tuned / default wall time: {m['tuned_over_default']:.2f}")
    if out["written"]:
        print(f"wrote {', '.join(out['written']['tree_files'].values())} and [tuned] in {out['written']['profile']}")


def apply_profile(args: argparse.Namespace) -> None:
    """For `lantern generate --profile NAME`: the profile supplies the backend (unless --backend), the dtype
    (unless --dtype), torch threads, and for static-tree methods the tree tuned for the batch width the
    generation runs at, min(images, --batch) (unless --drafting)."""
    if not getattr(args, "profile", None):
        return

    profile = load_profile(args.profile)
    if args.backend is None:
        args.backend = profile.backend
    if args.dtype is None:
        args.dtype = profile.dtype
    if profile.threads:
        torch.set_num_threads(profile.threads)
    width = min(len(args.classes), args.batch or DEFAULT_BATCH)
    tree_file = profile.tuned_tree_file(width)
    if args.drafting is None and args.method in STATIC_TREE_METHODS and tree_file is not None:
        if not tree_file.is_file():
            raise ValueError(f"profile {profile.name}: its tuned tree {tree_file} is missing; rerun "
                             f"`lantern profile tune --profile {profile.name}`")
        args.drafting = str(tree_file)


def profile_costs(spec: str):
    """`--method auto --profile NAME`: the profile's calibration from its results file, or None (said on stderr)
    when it has none, in which case auto uses this machine's cached calibration."""
    profile = load_profile(spec)
    path = default_results_path(profile)
    try:
        entries = calibration_entries(load_results(path)) if path.is_file() else {}
    except (SchemaError, UnreadableFile) as e:
        print(f"lantern: {e}", file=sys.stderr)
        entries = {}
    if not entries:
        print(f"lantern: profile {profile.name} has no calibration in {path} (run `lantern profile run --profile "
              f"{profile.name}`); auto uses this machine's calibration", file=sys.stderr)
        return None
    return ProfileCosts(profile.name, entries)
