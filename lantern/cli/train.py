"""CLI wiring for `lantern train tokenizer|target|drafter|evaluator` and `lantern info`.

Each `add_*` registers argparse subcommands on the main parser's subparsers; every handler prints its own
output and returns an exit code; `lantern.cli.main` turns exceptions into error messages and exit codes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from lantern.exit_codes import EXIT_BAD_INPUT, EXIT_OK


def _common(p: argparse.ArgumentParser, steps: int, batch: int, lr: float) -> None:
    p.add_argument("--work", required=True, help="output dir: weights, reports and the resumable <stage>.ckpt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 (default: bf16 autocast)")


def _train(args: argparse.Namespace) -> int:
    import torch

    from lantern.extras import require
    from lantern.embedded.train.pipeline import load_target, load_vq
    from lantern.embedded.train.tokens import token_dataset

    require("sklearn", "lantern train (the embedded digits data)", extra="train")
    if args.steps < 1 or args.batch < 1 or args.threads < 1 or not args.lr > 0:
        raise ValueError(f"--steps {args.steps}, --batch {args.batch} and --threads {args.threads} must be >= 1 "
                         f"and --lr {args.lr} > 0")
    torch.set_num_threads(args.threads)
    work, bf16 = Path(args.work), not args.no_bf16
    if getattr(args, "bundle", None):
        from lantern.embedded.train.bundle_drafter import train_bundle_drafter
        report = train_bundle_drafter(args.bundle, work, args.steps, args.batch, args.lr, args.seed, bf16,
                                      args.per_class, args.chunks, args.install)
        print(json.dumps(report, indent=2))
        return EXIT_OK
    common = dict(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed, bf16=bf16)
    if args.stage == "tokenizer":
        from lantern.models.vq import VQConfig
        from lantern.embedded.train.tokenizer import train_tokenizer
        report = train_tokenizer(str(work), VQConfig(codebook_size=args.codebook_size), **common)
    elif args.stage == "evaluator":
        from lantern.embedded.train.evaluator import train_evaluator
        report = train_evaluator(str(work), **common)
    else:
        for need in ("vq.safetensors", "vq_config.json"):
            if not (work / need).exists():
                raise FileNotFoundError(f"{work / need} is missing: run `lantern train tokenizer --work {work}` first")
        data = token_dataset(load_vq(work), args.n_aug, args.seed, cache_dir=str(work))
        if args.stage == "target":
            from lantern.models.config import gpt_preset
            from lantern.embedded.train.target import train_target
            cfg = gpt_preset(args.preset)
            report = train_target(str(work), cfg, *data["train"], data["heldout"], **common,
                                  init_from=args.init_from, name=args.name)
        else:
            from lantern.embedded.train.drafter import train_drafter
            if not (work / f"{args.target_name}.safetensors").exists():
                raise FileNotFoundError(f"{work / args.target_name}.safetensors is missing: "
                                        f"run `lantern train target` first")
            report = train_drafter(str(work), load_target(work, args.target_name), *data["train"], data["heldout"],
                                   **common)
    print(json.dumps(report, indent=2))
    return EXIT_OK


def add_train_commands(subparsers) -> None:
    p = subparsers.add_parser("train", help="train one stage of a bundle (tokenizer, target, drafter, evaluator)")
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


def _info(args: argparse.Namespace) -> int:
    from lantern.bundle import bundle_methods, describe_bundle, verify_bundle
    from lantern.cli.family import info_command, is_family_folder
    from lantern.files.reading import read_json_object
    if is_family_folder(args.model):
        return info_command(args)
    problems = verify_bundle(args.model)
    if args.json:
        from lantern.bundle import DEFAULT_BUNDLE
        root = Path(args.model) if args.model else DEFAULT_BUNDLE
        manifest = read_json_object(root / "manifest.json")
        print(json.dumps({"path": str(root), "problems": problems, "command": manifest.get("command"),
                          "seed": manifest.get("seed"), "data": manifest.get("data"),
                          "metrics": manifest.get("metrics"), "methods": bundle_methods(root)}))
    else:
        print(describe_bundle(args.model))
        print("integrity: ok (every file matches its manifest sha256)" if not problems
              else "integrity problems:\n  " + "\n  ".join(problems))
    return EXIT_OK if not problems else EXIT_BAD_INPUT


def add_info_command(subparsers) -> None:
    p = subparsers.add_parser("info", help="what a bundle or model-family folder is, and what runs on it")
    p.add_argument("--model", help="bundle folder or transformers model folder (default: the embedded model)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_info)
