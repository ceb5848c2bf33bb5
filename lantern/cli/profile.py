"""`lantern profile run | compare | calibrate` (the profile suite, lantern.profile), and what
`lantern generate --profile NAME` reads of a profile (`apply_profile`, `profile_costs`).

Exit codes (also the "exit_code" field of the --json object): 0 every case ok; 1 some case failed (each
is recorded in the results file with its error) or an internal error; 2 bad input (unknown profile, bad
value, incompatible results file); 3 the profile's backend is unavailable here (recorded as a failed case).
No command ever prompts.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lantern.api import Pipeline
from lantern.cli.parsing import number
from lantern.cli.sampling_flags import add_sampling_options, sampling_from_args
from lantern.exit_codes import EXIT_FAILED_CASES, EXIT_OK, EXIT_UNAVAILABLE
from lantern.files.atomic_io import check_writable
from lantern.files.reading import UnreadableFile
from lantern.bundle import load_bundle
from lantern.plan.backend_choice import choose_backend
from lantern.plan.calibration import ProfileCosts
from lantern.profile.hardware import load_profile, profile_from_dict
from lantern.profile.report import compare
from lantern.profile.schema import SchemaError, calibration_entries, load_results
from lantern.profile.suite import Suite, default_results_path


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

    c = sub.add_parser("compare", help="merge results files into one Markdown report")
    c.add_argument("files", nargs="+", help="results files (any machines and backends)")
    c.add_argument("--out", default="results/report", help="folder for report.md")
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
    check_writable(Path(args.out), "--out", folder=True)
    return compare(args.files, args.out)


def print_compare(out: dict) -> None:
    print(f"report: {out['report']}  ({len(out['runs'])} runs)")


def apply_profile(args: argparse.Namespace) -> None:
    """For `lantern generate --profile NAME`: the profile supplies the backend (unless --backend), the dtype
    (unless --dtype) and torch threads."""
    if not getattr(args, "profile", None):
        return

    profile = load_profile(args.profile)
    if args.backend is None:
        args.backend = profile.backend
    if args.dtype is None:
        args.dtype = profile.dtype
    if profile.threads:
        torch.set_num_threads(profile.threads)


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
