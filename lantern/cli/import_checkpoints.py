"""`lantern import`: LlamaGen's GPT and VQ checkpoints (plus a drafter and a proximity table, optionally) -> a
verified lantern bundle that `lantern generate --model` and `Pipeline.from_bundle` run."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from lantern.cli.parsing import number
from lantern.bundle.from_llamagen import ImportRequest, import_llamagen
from lantern.models.llamagen import LLAMAGEN_GPT_SIZES, WEIGHT_SETS
from lantern.models.proximity import CODEBOOK_PROXIMITIES, DEFAULT_K


def proximity_help() -> str:
    computed = ", ".join(f"'{name}' (computed from {what})" for name, what in CODEBOOK_PROXIMITIES.items())
    return (f"{computed}, LANTERN's top_*_indices.npy, or a lantern proximity.safetensors; the bundle keeps the "
            f"first --proximity-k neighbours")


def add_arguments(p) -> None:
    p.add_argument("--gpt", required=True, type=Path,
                   help="LlamaGen GPT checkpoint, c2i or t2i (.pt/.pth/.safetensors)")
    p.add_argument("--vq", required=True, type=Path,
                   help="LlamaGen VQ checkpoint (VQ-8 / VQ-16, as LlamaGen writes it)")
    p.add_argument("--out", required=True, type=Path, help="the bundle folder to create (new or empty)")
    p.add_argument("--preset", choices=tuple(LLAMAGEN_GPT_SIZES),
                   help="the GPT's LlamaGen size (default: inferred from its depth and width)")
    p.add_argument("--heads", type=number(int, 1),
                   help="attention heads, for a GPT of no LlamaGen size (its depth and width match none)")
    p.add_argument("--image-size", type=number(int, 8), default=256,
                   help="image side in pixels the GPT was trained at (256, 384, 512; default 256)")
    p.add_argument("--weights", choices=WEIGHT_SETS, default="model",
                   help="which weights of the GPT checkpoint: model (default) or ema")
    p.add_argument("--drafter", type=Path,
                   help="lantern's drafter.safetensors, or LANTERN's drafter folder (config.json + pytorch_model.bin "
                        "or model.safetensors)")
    p.add_argument("--proximity", help=proximity_help())
    p.add_argument("--proximity-k", type=number(int, 1), default=DEFAULT_K,
                   help=f"neighbours per code the bundle keeps (default {DEFAULT_K}: LANTERN's largest k)")
    p.add_argument("--link", action="store_true",
                   help="reference the GPT and VQ files where they are instead of copying them")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_import, show=print_import)


def cmd_import(args) -> dict:
    req = ImportRequest(gpt=args.gpt, vq=args.vq, out=args.out, image_size=args.image_size, preset=args.preset,
                        heads=args.heads, weights=args.weights, drafter=args.drafter, proximity=args.proximity,
                        k=args.proximity_k, link=args.link, command="lantern " + shlex.join(sys.argv[1:]))
    return import_llamagen(req, progress=not args.json)


def print_import(out: dict) -> None:
    extras = [x for x in (out["drafter"] and "a drafter",
                          out["proximity_k"] and f"a proximity table of {out['proximity_k']} neighbours") if x]
    print(f"bundle {out['bundle']}: LlamaGen {out['size']} {out['model_type']} + {out['vq']} "
          f"({out['vocab_size']} codes, {out['image_size']}px)" + (f" with {' and '.join(extras)}" if extras else "")
          + (", weights linked" if out["linked"] else ""))
    if out["vq_training_only_keys_dropped"]:
        print(f"dropped the VQ's training-only buffers: {', '.join(out['vq_training_only_keys_dropped'])}")
    print(f"methods: {', '.join(out['methods'])}")
