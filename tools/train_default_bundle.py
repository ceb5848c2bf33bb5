"""Train the embedded default bundle end to end and write it to lantern/assets/default (or --out).

Every stage checkpoints into --work and resumes from there, so re-running this script after an
interruption continues where it stopped; re-running it after completion only re-measures and re-packs.

    python tools/train_default_bundle.py --work runs/default --out lantern/assets/default

The same stages one by one through the CLI (then this script only measures and packs):
    lantern train tokenizer --work W
    lantern train target --work W                                   # phase 1: 600 steps, lr 1e-3
    lantern train target --work W --init-from W/target.safetensors --name target2 --steps 250 --lr 4e-4 --seed 1
    lantern train drafter --work W                                  # drafts for W/target2
    lantern train evaluator --work W
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from lantern.config import gpt_preset
from lantern.models.classifier import ClassifierConfig
from lantern.models.vq import VQConfig
from lantern.train.pipeline import PipelineSettings, build_bundle, run_pipeline


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="checkpoints and intermediate outputs")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "lantern" / "assets" / "default"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = PipelineSettings(
        seed=args.seed,
        vq=VQConfig(), vq_steps=300, vq_batch=32, vq_lr=2e-3,
        gpt=gpt_preset("GPT-lantern-digits"), n_aug=6, target_steps=600, target_batch=16, target_lr=1e-3,
        target2_steps=250, target2_lr=4e-4,
        drafter_steps=250, drafter_batch=16, drafter_lr=1e-3,
        evaluator=ClassifierConfig(), evaluator_steps=300, evaluator_batch=64,
        cfg_scale=5.0, temperature=1.0, top_k=20, eval_per_class=20,
    )
    t0 = time.time()
    reports = run_pipeline(args.work, settings)
    command = "python tools/train_default_bundle.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    build_bundle(args.work, args.out, settings, reports, command=command, threads=args.threads)
    print(f"bundle written to {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
