"""`lantern export-onnx`: write the ONNX graphs a generation will need, for deployment.

The graphs are exactly those `lantern generate` prepares for the same method, tree, guidance and image
count (the StaticSpec comes from the decode loop's own `static_spec`), written into --out; point
LANTERN_ONNX_CACHE at that folder on the deployment machine and the onnx backend loads them as they are.
Exit codes: 0 written, 2 bad input, 3 the onnx backend is unavailable here.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

EXIT_OK, EXIT_BAD_INPUT, EXIT_UNAVAILABLE = 0, 2, 3


def add_export_onnx_command(subparsers) -> argparse.ArgumentParser:
    """Register `export-onnx`: `func` returns a result dict (the lantern CLI's protocol, errors raised),
    `handler` returns an exit code (standalone use)."""
    from lantern.config import GPT_PRESETS
    from lantern.decoding import METHODS

    p = subparsers.add_parser("export-onnx", help="export the ONNX graphs of a generation setup into a folder",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=sorted(GPT_PRESETS), help="target model shape")
    p.add_argument("--checkpoint", help="target weights (LlamaGen .pt/.pth or .safetensors); without it: "
                                        "random weights from --seed (for tests and timing only)")
    p.add_argument("--drafter-checkpoint", help="drafter weights (speculative methods)")
    p.add_argument("--method", default="lantern++", choices=METHODS, help="as for generate (same default)")
    p.add_argument("--drafting", help="override the method's drafting: dynamic, a tree preset or a .json of paths")
    p.add_argument("--cfg-scale", type=float, default=1.0,
                   help="the scale generate will use: > 1 exports the two-row CFG batch")
    p.add_argument("--images", type=int, default=1, help="images per AR batch")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder to write the graphs (one folder each) into")
    p.add_argument("--force", action="store_true", help="export again even when an intact graph exists")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_export_onnx, show=print_export_onnx, handler=run_export_onnx)
    return p


def cmd_export_onnx(args: argparse.Namespace) -> dict:
    """Export (or reuse) every graph; raises BackendUnavailable, ValueError or FileNotFoundError."""
    from lantern.backends import BackendUnavailable
    from lantern.backends.onnx_export import ensure_graphs
    from lantern.backends.onnx_runtime import ONNXBackend
    from lantern.config import gpt_preset
    from lantern.decoding import SamplingConfig, method_preset
    from lantern.decoding.loop import static_spec
    from lantern.models.checkpoint import load_checkpoint
    from lantern.models.drafter import Drafter
    from lantern.models.gpt import GPT

    avail = ONNXBackend.availability()
    if not avail.ok:
        raise BackendUnavailable(f"onnx: {avail.reason}")
    if args.images < 1:
        raise ValueError(f"--images {args.images} must be >= 1")
    overrides = {"drafting": args.drafting} if args.drafting else {}
    dcfg = method_preset(args.method, SamplingConfig(cfg_scale=args.cfg_scale), **overrides)
    ONNXBackend().check_dtype(args.dtype)
    torch.manual_seed(args.seed)
    target = GPT(gpt_preset(args.preset)).eval()
    drafter = Drafter(target.config).eval() if dcfg.speculative else None
    if args.checkpoint:
        load_checkpoint(target, args.checkpoint)
    if drafter is not None and args.drafter_checkpoint:
        load_checkpoint(drafter, args.drafter_checkpoint)
    random_weights = not args.checkpoint or (drafter is not None and not args.drafter_checkpoint)
    spec = static_spec(dcfg, target.config, args.images if not dcfg.speculative else 1, args.dtype)
    paths = ensure_graphs(target, drafter, spec, Path(args.out), force=args.force)
    import onnxruntime as ort

    for path in paths.values():  # every written graph must open in the runtime it is for
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return {"spec": asdict(spec), "graphs": {k: str(v) for k, v in paths.items()}, "random_weights": random_weights,
            "cache_env": f"LANTERN_ONNX_CACHE={Path(args.out).resolve()}"}


def print_export_onnx(out: dict) -> None:
    for name, path in out["graphs"].items():
        print(f"{name:<16} {path}")
    if out["random_weights"]:
        print("note: no checkpoint for every model: these graphs hold random weights (tests and timing only)")
    print(f"use them with: {out['cache_env']} LANTERN_BACKEND=onnx lantern generate ...")


def run_export_onnx(args: argparse.Namespace) -> int:
    from lantern.backends import BackendUnavailable

    try:
        out = cmd_export_onnx(args)
    except BackendUnavailable as e:
        print(f"export-onnx: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (ValueError, FileNotFoundError) as e:
        print(f"export-onnx: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(out))
    else:
        print_export_onnx(out)
    return EXIT_OK


def main(argv: Optional[list[str]] = None) -> int:
    """Standalone entry (`python -m lantern.onnx_cli export-onnx ...`), the same as the lantern subcommand."""
    parser = argparse.ArgumentParser(prog="lantern")
    add_export_onnx_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
