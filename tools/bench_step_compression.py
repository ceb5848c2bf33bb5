"""Lossless Jacobi decoding side by side, as SJD-PAC's table reports it: step compression (an image's tokens / the
target forwards it took) of SJD, MC-SJD and MC-SJD-PAC windows (branching, branch depth, tail), with the verify width
each pays for it, on the embedded model (or, with --shape, its function-preserving inflation to LlamaGen's GPT-B or
GPT-L, lantern.models.inflate) at the bundle's sampling and at LlamaGen's class-to-image one, one image per step and
all of them in one batch; and where the forwards go: those spent on the image's first grid row (which has no
row above to draft from), and the step compression of the rows below it. A count, not a timing: it holds on a busy
machine and on any backend (the wall-clock side is tools/bench_scale.py, on a quiet machine). Writes
results/step-compression.{json,md}.

    python tools/bench_step_compression.py [--images 20] [--sampling bundle llamagen-c2i] [--batch 1 20]
        [--rows sjd:window=16 mc-sjd:window=16 mc-sjd-pac:branching=2:branch_depth=1 ...] [--resume]
        [--shape embedded|GPT-B|GPT-L] [--dtype fp32|bf16]

Each finished row is kept in <out>.partial.json; `--resume` takes the rows it holds for the same settings and
commit instead of counting them again.
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from tqdm import tqdm

from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.backends.environment import provenance
from lantern.decoding import method_preset
from lantern.files import atomic_io
from lantern.models.inflate import INFLATE_SHAPES, inflate_models
from results_io import utc_now, write_results
from samplings import NAMES as SAMPLING_NAMES, describe, sampling_settings

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["sjd:window=16", "mc-sjd:window=16", "mc-sjd:window=32", "mc-sjd-pac:branching=2:branch_depth=1",
        "mc-sjd-pac:branching=3:branch_depth=1", "mc-sjd-pac:branching=2:branch_depth=2",
        "mc-sjd-pac:branching=3:branch_depth=2", "mc-sjd-pac:branching=2:branch_depth=3"]


def parse_row(text: str) -> tuple[str, dict]:
    """'mc-sjd-pac:branching=2:branch_depth=1' -> ('mc-sjd-pac', {'branching': 2, 'branch_depth': 1})."""
    method, *pairs = text.split(":")
    settings = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if not value.lstrip("-").isdigit():
            raise SystemExit(f"row {text!r}: {pair!r} is not name=integer")
        settings[name] = int(value)
    return method, settings


def form_config(text: str, sampling, relaxation: dict | None = None):
    """A preset or a form of one ('mc-sjd-pac:fan=60') at `sampling` -> its DecodeConfig: the preset, with the
    settings a bundle validated for it there (`relaxation`: Bundle.relaxation_at), then the form's own."""
    method, settings = parse_row(text)
    return method_preset(method, sampling, **{**(relaxation or {}).get(method, {}), **settings})


def first_row(image, grid: int) -> tuple[int, int]:
    """An image's (forwards, tokens) on its first grid row: the prefill (which decides token 0) and every step
    whose first token lies in that row, with the tokens they committed."""
    forwards, tokens = 1, 1
    for length in image.accepted_lengths:
        if tokens >= grid:
            break
        forwards, tokens = forwards + 1, tokens + length
    return forwards, tokens


def measure(pipe, dcfg, classes: list[int], batch: int, seed: int) -> dict:
    result = pipe.generate(classes, dcfg, seed=seed, batch=batch, allow_relaxed=True)
    st = result.stats
    lengths = collections.Counter(st.accepted_lengths)
    steps = sum(lengths.values())
    row = [first_row(image, pipe.config.grid_size) for image in st.images]
    row_forwards, row_tokens = sum(f for f, _ in row), sum(t for _, t in row)
    return {"tokens": st.tokens, "target_forwards": st.target_forwards,
            "single_token_steps": lengths[1] / steps if steps else 0.0,
            "first_row_forwards": row_forwards / len(row),
            "below_first_row": (st.tokens - row_tokens) / (st.target_forwards - row_forwards)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=20, help="images per setting (classes 0, 1, ... in turn)")
    ap.add_argument("--sampling", nargs="+", default=list(SAMPLING_NAMES), choices=SAMPLING_NAMES)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 20], help="images per static step")
    ap.add_argument("--rows", nargs="+", default=ROWS, help="method:name=value:... (the preset, then these)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", default=str(ROOT / "results" / "step-compression"))
    ap.add_argument("--resume", action="store_true", help="keep the rows <out>.partial.json holds for these settings")
    ap.add_argument("--shape", default="embedded", choices=["embedded", *sorted(INFLATE_SHAPES)],
                    help="the embedded model, or its inflation to a LlamaGen compute shape (same acceptance)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    rows = [(text, *parse_row(text)) for text in args.rows]  # refused before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_bundle()
    if args.shape == "embedded":
        pipe = Pipeline.from_bundle(bundle, backend="cpu", dtype=args.dtype)
    else:
        models = inflate_models(bundle.target, bundle.drafter, bundle.proximity, args.shape)
        pipe = Pipeline(models.target, models.drafter, models.proximity, backend="cpu", dtype=args.dtype)
    n_classes = bundle.target.config.num_classes
    classes = [i % n_classes for i in range(args.images)]
    settings = sampling_settings(bundle.default_sampling, args.sampling)
    partial = Path(args.out).with_suffix(".partial.json")
    key = {"commit": provenance()["commit"], "images": args.images, "seed": args.seed, "shape": args.shape,
           "dtype": args.dtype}
    done = {}
    if args.resume and partial.exists():
        kept = json.loads(partial.read_text())
        if kept.get("key") == key:
            done = {(r["sampling"], r["batch"], r["row"]): r for r in kept["rows"]}
    results = []
    jobs = [(s, b, r) for s in settings for b in args.batch for r in rows]
    for name, batch, (text, method, overrides) in tqdm(jobs, desc="rows"):
        if (name, batch, text) not in done:
            dcfg = method_preset(method, settings[name], **overrides)
            counted = measure(pipe, dcfg, classes, batch, args.seed)
            done[name, batch, text] = {"sampling": name, "batch": batch, "row": text, "method": method,
                                       "settings": overrides, "verify_width": dcfg.verify_width,
                                       "step_compression": counted["tokens"] / counted["target_forwards"],
                                       **counted}
            atomic_io.write_text(partial, json.dumps({"key": key, "rows": list(done.values())}))
        results.append(done[name, batch, text])
    record = {"date": utc_now(), "images": args.images, "seed": args.seed, "shape": args.shape, "dtype": args.dtype,
              "samplings": {n: describe(s) for n, s in settings.items()}, "rows": results}
    write_results(args.out, record, markdown)
    partial.unlink(missing_ok=True)


def markdown(rec: dict) -> str:
    model = "the embedded model" + ("" if rec["shape"] == "embedded" else f" inflated to {rec['shape']}")
    lines = [f"Lossless Jacobi decoding on {model}, {rec['dtype']}: step compression (tokens / target "
             f"forwards, per image) over {rec['images']} images, seed {rec['seed']}; {rec['date']}. A count, the same "
             f"on any machine for the same commit; the verify width is the nodes each target forward takes per image."]
    for name, text in rec["samplings"].items():
        for batch in sorted({r["batch"] for r in rec["rows"]}):
            rows = [r for r in rec["rows"] if r["sampling"] == name and r["batch"] == batch]
            if not rows:
                continue
            lines += ["", f"**{name} ({text}), {batch} image(s) per step**", "",
                      "| row | verify width | step compression | steps accepting no draft | forwards on the first "
                      "grid row | step compression below it |", "|---|---|---|---|---|---|"]
            lines += [f"| {r['row']} | {r['verify_width']} | {r['step_compression']:.2f} | "
                      f"{r['single_token_steps']:.0%} | {r['first_row_forwards']:.1f} | "
                      f"{r['below_first_row']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
