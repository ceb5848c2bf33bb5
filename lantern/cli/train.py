"""`lantern train tokenizer|target|drafter|evaluator`: one stage of the embedded model's training
(lantern.embedded.train), or a drafter for any class-to-image bundle. Prints its report, returns an exit code.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lantern.embedded.train.bundle_drafter import train_bundle_drafter
from lantern.embedded.train.drafter import train_drafter
from lantern.embedded.train.evaluator import train_evaluator
from lantern.embedded.train.pipeline import load_target, load_vq
from lantern.embedded.train.target import train_target
from lantern.embedded.train.tokenizer import train_tokenizer
from lantern.embedded.train.tokens import token_dataset
from lantern.exit_codes import EXIT_OK
from lantern.extras import require
from lantern.models.config import gpt_preset
from lantern.models.vq import VQConfig


def _common(p: argparse.ArgumentParser, steps: int, batch: int, lr: float) -> None:
    p.add_argument("--work", required=True, help="output dir: weights, reports and the resumable <stage>.ckpt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 (default: bf16 autocast)")


def _train(args: argparse.Namespace) -> int:
    require("sklearn", "lantern train (the embedded digits data)", extra="train")
    if args.steps < 1 or args.batch < 1 or args.threads < 1 or not args.lr > 0:
        raise ValueError(f"--steps {args.steps}, --batch {args.batch} and --threads {args.threads} must be >= 1 "
                         f"and --lr {args.lr} > 0")
    torch.set_num_threads(args.threads)
    work, bf16 = Path(args.work), not args.no_bf16
    if getattr(args, "bundle", None):
        report = train_bundle_drafter(args.bundle, work, args.steps, args.batch, args.lr, args.seed, bf16,
                                      args.per_class, args.chunks, args.install)
        print(json.dumps(report, indent=2))
        return EXIT_OK
    common = dict(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed, bf16=bf16)
    if args.stage == "tokenizer":
        report = train_tokenizer(str(work), VQConfig(codebook_size=args.codebook_size), **common)
    elif args.stage == "evaluator":
        report = train_evaluator(str(work), **common)
    else:
        for need in ("vq.safetensors", "vq_config.json"):
            if not (work / need).exists():
                raise FileNotFoundError(f"{work / need} is missing: run `lantern train tokenizer --work {work}` first")
        data = token_dataset(load_vq(work), args.n_aug, args.seed, cache_dir=str(work))
        if args.stage == "target":
            cfg = gpt_preset(args.preset)
            report = train_target(str(work), cfg, *data["train"], data["heldout"], **common,
                                  init_from=args.init_from, name=args.name)
        else:
            if not (work / f"{args.target_name}.safetensors").exists():
                raise FileNotFoundError(f"{work / args.target_name}.safetensors is missing: "
                                        f"run `lantern train target` first")
            report = train_drafter(str(work), load_target(work, args.target_name), *data["train"], data["heldout"],
                                   **common)
    print(json.dumps(report, indent=2))
    return EXIT_OK


def add_arguments(p) -> None:
    stages = p.add_subparsers(dest="stage", required=True)
    t = stages.add_parser("tokenizer", help="the VQ tokenizer on the digits training split")
    _common(t, steps=300, batch=32, lr=2e-3)
    t.add_argument("--codebook-size", type=int, default=1024)
    g = stages.add_parser("target", help="the class-conditional GPT on the tokenizer's codes")
    _common(g, steps=600, batch=16, lr=1e-3)
    g.add_argument("--preset", default="GPT-lantern-digits", help="a lantern.models.config.GPT_PRESETS name")
    g.add_argument("--n-aug", type=int, default=6, help="copies of each training image (copy 0 un-augmented)")
    g.add_argument("--init-from", help="continue from these target weights (a second phase) instead of a fresh init")
    g.add_argument("--name", default="target", help="output name: <work>/<name>.safetensors")
    d = stages.add_parser("drafter", help="the EAGLE drafter on the frozen target's features")
    _common(d, steps=250, batch=16, lr=1e-3)
    d.add_argument("--n-aug", type=int, default=6)
    d.add_argument("--target-name", default="target", help="the target in --work to draft for")
    d.add_argument("--bundle", help="draft for this c2i bundle's target (an imported one too), trained on the "
                                    "target's own samples instead of the digits data")
    d.add_argument("--per-class", type=int, default=4, help="--bundle: samples of each class per chunk")
    d.add_argument("--chunks", type=int, default=8, help="--bundle: sample chunks (the last is held out)")
    d.add_argument("--install", action="store_true", help="--bundle: put the trained drafter into the bundle")
    e = stages.add_parser("evaluator", help="the classifier behind `lantern eval`")
    _common(e, steps=300, batch=64, lr=2e-3)
    for sp in (t, g, d, e):
        sp.set_defaults(func=_train)
