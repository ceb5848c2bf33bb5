"""`lantern export-onnx`: write the ONNX graphs a generation will need, for deployment.

The graphs are exactly those `lantern generate` prepares for the same model, method, tree, guidance and batch
width (the StaticSpec comes from the step engine's own `static_spec`), written into --out; point
LANTERN_ONNX_CACHE at that folder on the deployment machine and the onnx backend loads them as they are.
The model is a bundle, as for generate (default: the embedded one, with its sampling defaults), or a
--preset shape with LlamaGen --checkpoint weights (random weights without one: tests and timing only).
Exit codes (lantern.exit_codes): 0 written, 2 bad input, 3 the onnx backend is unavailable here.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import torch

from lantern.backends import BackendUnavailable
from lantern.backends.onnx_export import ensure_graphs
from lantern.backends.onnx_runtime import ONNXBackend
from lantern.cli.parsing import UsageError, number
from lantern.decoding import METHODS, SamplingConfig, method_preset
from lantern.engine.step import static_spec
from lantern.extras import require
from lantern.files.atomic_io import check_writable
from lantern.bundle import load_bundle
from lantern.models.checkpoint import load_checkpoint
from lantern.models.config import GPT_PRESETS, gpt_preset
from lantern.models.drafter import Drafter, prefix_pairs
from lantern.models.gpt import GPT


def add_arguments(p) -> None:
    p.description, p.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="bundle folder, as for generate (default: the embedded model)")
    source.add_argument("--preset", choices=sorted(GPT_PRESETS), help="instead of a bundle: a target model shape")
    p.add_argument("--checkpoint", help="with --preset: target weights (LlamaGen .pt/.pth or .safetensors); "
                                        "without it: random weights from --seed (tests and timing only)")
    p.add_argument("--drafter-checkpoint", help="with --preset: drafter weights (speculative methods)")
    p.add_argument("--method", default="lantern++", choices=METHODS, help="as for generate (same default)")
    p.add_argument("--drafting", help="override the method's drafting: dynamic, a tree preset or a .json of paths")
    p.add_argument("--window", type=number(int, 1), help="Jacobi methods: the window generate will use (default 16)")
    p.add_argument("--cfg-scale", type=number(float, 1),
                   help="the scale generate will use, >= 1: > 1 exports the two-row CFG batch (default: the "
                        "bundle's; required with --preset)")
    p.add_argument("--batch", type=number(int, 1), default=4,
                   help="images per static step, as generate will run them: min(its --batch, its number of images) "
                        "(default 4: generate's default of 4 classes)")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--seed", type=int, default=0, help="with --preset and no checkpoint: the random weights' seed")
    p.add_argument("--out", required=True, help="folder to write the graphs (one folder each) into")
    p.add_argument("--force", action="store_true", help="export again even when an intact graph exists")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_export_onnx, show=print_export_onnx)


def export_models(args: argparse.Namespace, needs_drafter: bool):
    """(target, drafter or None, default cfg scale or None, whether any weights are random)."""
    if args.preset is None:
        if args.checkpoint or args.drafter_checkpoint:
            raise UsageError("--checkpoint and --drafter-checkpoint go with --preset; a bundle (--model) holds "
                             "its own weights")
        bundle = load_bundle(args.model)
        if needs_drafter and bundle.drafter is None:
            raise UsageError(f"bundle {bundle.path} has no drafter; method {args.method!r} needs one")
        return bundle.target, bundle.drafter if needs_drafter else None, bundle.default_sampling["cfg_scale"], False

    torch.manual_seed(args.seed)
    target = GPT(gpt_preset(args.preset)).eval()
    drafter = Drafter(target.config).eval() if needs_drafter else None
    if args.checkpoint:
        load_checkpoint(target, args.checkpoint)
    if drafter is not None and args.drafter_checkpoint:
        load_checkpoint(drafter, args.drafter_checkpoint)
    random_weights = not args.checkpoint or (drafter is not None and not args.drafter_checkpoint)
    return target, drafter, None, random_weights


def cmd_export_onnx(args: argparse.Namespace) -> dict:
    """Export (or reuse) every graph; raises BackendUnavailable, ValueError or FileNotFoundError."""
    require("onnx", "lantern export-onnx")
    require("onnxruntime", "lantern export-onnx")
    avail = ONNXBackend.availability()
    if not avail.ok:
        raise BackendUnavailable(f"onnx: {avail.reason}")
    if args.preset is not None and args.cfg_scale is None:
        raise UsageError("--preset has no sampling defaults: pass the --cfg-scale generate will use")
    ONNXBackend().check_dtype(args.dtype)
    overrides = {k: getattr(args, k) for k in ("drafting", "window") if getattr(args, k) is not None}
    needs_drafter = method_preset(args.method, SamplingConfig(), **overrides).needs_drafter
    check_writable(Path(args.out), "--out", folder=True)
    target, drafter, default_cfg, random_weights = export_models(args, needs_drafter)
    cfg_scale = args.cfg_scale if args.cfg_scale is not None else default_cfg
    dcfg = method_preset(args.method, SamplingConfig(cfg_scale=cfg_scale), **overrides)
    spec = static_spec(dcfg, target.config, args.batch, args.dtype,
                       draft_prefix=prefix_pairs(drafter, target.config))
    paths = ensure_graphs(target, drafter, spec, Path(args.out), force=args.force)
    import onnxruntime as ort  # the onnx extra, required above

    for path in paths.values():  # every written graph must open in the runtime it is for
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return {"spec": asdict(spec), "cfg_scale": cfg_scale, "graphs": {k: str(v) for k, v in paths.items()},
            "random_weights": random_weights, "cache_env": f"LANTERN_ONNX_CACHE={Path(args.out).resolve()}"}


def print_export_onnx(out: dict) -> None:
    for name, path in out["graphs"].items():
        print(f"{name:<16} {path}")
    if out["random_weights"]:
        print("note: no checkpoint for every model: these graphs hold random weights (tests and timing only)")
    print(f"use them with: {out['cache_env']} LANTERN_BACKEND=onnx lantern generate ...")
