"""What tools/gpu_check.py reads from its caller, checked before any section runs: a typo that only its last section
read (`--model` in serve) cost a whole GPU lease. Each problem names the value and what is allowed; the check
refuses them all at once (exit 2) instead of one per lease."""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Optional


def input_problems(args, default_stem: Optional[Path], environ: dict) -> list[str]:
    """Every problem with the parsed arguments (as given, before --quick replaces its sizes), the results stem
    (--out, else `default_stem`; None: a fresh temporary one), the results file --resume reads there and the
    environment ($OUT); [] when all is well."""
    problems = number_problems(args)
    if not args.quick:
        problems += token_problems(args, embedded_tokens_per_image())
    problems += model_problems(args.model, args.serve_method)
    if args.out is not None:
        problems += stem_problems(f"--out {args.out!r}", Path(args.out), args.resume)
    elif default_stem is not None:
        problems += stem_problems(f"the results stem {default_stem}", default_stem, args.resume)
    out = environ.get("OUT")
    if out and not writable_folder(Path(out)):
        problems.append(f"$OUT {out} is not a writable folder; allowed: an existing folder the results are copied "
                        f"to, or $OUT unset")
    return problems


def number_problems(args) -> list[str]:
    """Seconds finite and positive, counts whole and at least 1."""
    problems = []
    for flag, value in (("--budget-s", args.budget_s), ("--serve-s", args.serve_s)):
        if value is not None and not (math.isfinite(value) and value > 0):
            problems.append(f"{flag} {value} is not allowed; allowed: a finite number of seconds > 0")
    counts = [("--clients", args.clients), ("--parity-tokens", args.parity_tokens), ("--tokens", args.tokens),
              ("--sync-tokens", args.sync_tokens), *(("--images", n) for n in args.images)]
    problems += [f"{flag} {value} is not allowed; allowed: an integer >= 1" for flag, value in counts
                 if value is not None and value < 1]
    return problems


def embedded_tokens_per_image() -> int:
    """The embedded model's image tokens (its config, no weights): what parity, sync and the timing shapes decode
    (inflation keeps the grid)."""
    from lantern.bundle import DEFAULT_BUNDLE
    return json.loads((DEFAULT_BUNDLE / "config.json").read_text())["target"]["block_size"]


def token_problems(args, per_image: int) -> list[str]:
    return [f"{flag} {value} is not allowed; allowed: 1..{per_image}, the embedded model's tokens per image"
            for flag, value in (("--tokens", args.tokens), ("--parity-tokens", args.parity_tokens),
                                ("--sync-tokens", args.sync_tokens)) if value is not None and value > per_image]


def model_problems(model: Optional[str], serve_method: str) -> list[str]:
    """--model: a class-conditional lantern bundle that loads (the serve section sends class ids to `lantern
    serve --model` and `lantern generate --model`), able to run --serve-method."""
    from lantern.bundle import bundle_methods, load_bundle
    if model is None:
        return []
    try:
        bundle = load_bundle(model)
    except (ValueError, OSError) as e:
        return [f"--model {model} is not allowed ({e}); allowed: a lantern bundle folder (default: the embedded "
                f"model)"]
    if bundle.target.config.model_type != "c2i":
        return [f"--model {model} is a {bundle.target.config.model_type} bundle; allowed: a class-conditional "
                f"(c2i) bundle, whose requests the serve section sends as class ids"]
    methods = ["auto", *bundle_methods(model)]
    if serve_method not in methods:
        return [f"--serve-method {serve_method} cannot run on --model {model}; allowed: {', '.join(methods)}"]
    return []


def stem_problems(named: str, stem: Path, resume: bool) -> list[str]:
    """A results stem (`named` says where it came from) whose .json/.md/.png can be written; with --resume, a
    results file there must be one."""
    if not stem.name or stem.name in (".", ".."):
        return [f"{named} is not allowed; allowed: a file stem such as results/gpu-run (not a folder alone)"]
    folder = next((p for p in (stem.parent, *stem.parent.parents) if p.exists()), Path("."))
    if not writable_folder(folder):
        return [f"{named}: {folder} is not a folder a file can be written in; allowed: a stem under a writable "
                f"folder"]
    taken = [str(stem.with_suffix(s)) for s in (".json", ".md", ".png") if stem.with_suffix(s).is_dir()]
    if taken:
        return [f"{named}: {', '.join(taken)} is a folder; allowed: a stem whose results files are files"]
    if resume and stem.with_suffix(".json").exists():
        problem = earlier_record_problem(stem.with_suffix(".json"))
        if problem:
            return [f"--resume: {stem.with_suffix('.json')} {problem}; allowed: a results file an earlier run "
                    f"wrote, or none"]
    return []


def earlier_record_problem(path: Path) -> Optional[str]:
    """What --resume reads of an earlier results file, or why it cannot: its sections, their env's commit, and
    each timing row's group and row names."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"is not readable JSON ({type(e).__name__}: {e})"
    sections = record.get("sections") if isinstance(record, dict) else None
    if not isinstance(sections, dict) or not isinstance(sections.get("env"), dict):
        return "has no 'sections' object with an 'env' object"
    rows = sections.get("timing", {}).get("rows", []) if isinstance(sections.get("timing"), dict) else None
    keys = ("shape", "images", "sampling", "mode", "method")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in keys) for r in rows):
        return f"has timing rows without {', '.join(keys)}"
    return None


def writable_folder(path: Path) -> bool:
    """Whether a file can be made in `path` (tried: permission bits say yes to root even on /proc)."""
    if not path.is_dir():
        return False
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False
