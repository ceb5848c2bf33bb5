"""Rebuild the embedded default bundle from a base bundle and write it to lantern/assets/default (or --out).

The base bundle's tokenizer and evaluator are kept as they are; its 6-layer target is grown to 12 layers (every
layer doubled, the copy's output projections zeroed: lantern.embedded.train.grow) and trained on. Then the sampling
defaults are chosen by an evaluator sweep on a separate seed, the grown target samples its own training data for
the drafter (batched AR through lantern.api.Pipeline), and the drafter is trained on those plus the real data.
Every stage caches or checkpoints into --work and resumes from there; re-running after completion only packs.
With --reuse-target BUNDLE (a bundle this script built with the same target settings), the tokenizer, evaluator
and target are taken from that bundle and only the drafter stage runs: how the drafter of
lantern/assets/default was rebuilt on its target.

The base used for lantern/assets/default is the 6-layer bundle of commit fe25dc9:
    mkdir -p BASE && git archive fe25dc9 lantern/assets/default | tar -x -C BASE
    python tools/train_default_bundle.py --base BASE/lantern/assets/default --work runs/default \\
        --out lantern/assets/default
    python tools/train_default_bundle.py --work runs/drafter --reuse-target lantern/assets/default \\
        --threads 2     # the drafter stage alone, on the bundle's own target
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from lantern.models.config import gpt_preset
from lantern.embedded.train.pipeline import PipelineSettings, build_bundle, distil_drafter, reuse_target, run_pipeline

DRAFTER_STEPS = 3000  # batches of 32 rows; the features are computed once (lantern.embedded.train.drafter.feature_bank)
SAMPLING_CANDIDATES = tuple({"cfg_scale": cfg, "temperature": 1.0, "top_k": k}
                            for cfg, k in ((3.0, 5), (2.0, 5)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the bundle whose tokenizer and evaluator are kept and whose target is grown")
    ap.add_argument("--work", required=True, help="checkpoints and intermediate outputs")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "lantern" / "assets" / "default"))
    ap.add_argument("--reuse-target", help="take the tokenizer, evaluator and target (and their reports) from this "
                                           "bundle, built with the same target settings; train only the drafter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on cores shared with other work)")
    args = ap.parse_args(argv)
    if not (args.base or args.reuse_target):
        ap.error("give --base (a full rebuild) or --reuse-target (the drafter stage alone)")
    torch.set_num_threads(args.threads)
    settings = PipelineSettings(
        seed=args.seed, gpt=gpt_preset("GPT-lantern-digits"), n_aug=6,
        target_steps=700, target_batch=16, target_lr=6e-4,
        sampling_candidates=SAMPLING_CANDIDATES, selection_seed=100, selection_per_class=10,
        self_sample_chunks=20, self_sample_per_class=10, self_sample_seed=1000,
        drafter_steps=DRAFTER_STEPS, drafter_batch=32, drafter_lr=1e-3, drafter_self_fraction=0.5,
        eval_per_class=20,
    )
    t0 = time.time()
    if args.reuse_target:
        reports = reuse_target(args.work, args.reuse_target, settings)
        reports["drafter"] = distil_drafter(Path(args.work), settings, reports["sampling"]["chosen"])
    else:
        reports = run_pipeline(args.work, args.base, settings)
    command = "python tools/train_default_bundle.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    build_bundle(args.work, args.out, settings, reports, command=command, threads=args.threads)
    print(f"bundle written to {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
