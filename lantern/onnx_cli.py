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
    from lantern.config import GPT_PRESETS
    from lantern.decoding import METHODS

    p = subparsers.add_parser("export-onnx", help="export the ONNX graphs of a generation setup into a folder",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=sorted(GPT_PRESETS), help="target model shape")
    p.add_argument("--checkpoint", help="target weights (.pt/.pth or .safetensors, LlamaGen keys); "
                                        "without it: random weights from --seed (for tests and timing only)")
    p.add_argument("--drafter-checkpoint", help="drafter weights (speculative methods)")
    p.add_argument("--method", default="ar", choices=METHODS)
    p.add_argument("--tree", help="override the method's drafting: a tree preset, a .json of paths or 'dynamic'")
    p.add_argument("--cfg-scale", type=float, default=1.0, help="> 1 exports the two-row CFG batch")
    p.add_argument("--images", type=int, default=1, help="images per AR batch")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder to write the graphs and their manifests into")
    p.add_argument("--force", action="store_true", help="export again even when an intact file exists")
    p.set_defaults(handler=run_export_onnx)
    return p


def load_weights(module: torch.nn.Module, path: str) -> None:
    """Load a state dict (optionally under 'model', 'module' or 'state_dict') strictly into `module`."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"checkpoint {path!r} is not a file")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(file))
    else:
        state = torch.load(str(file), map_location="cpu", weights_only=True)
        for key in ("model", "module", "state_dict"):
            if isinstance(state, dict) and key in state and isinstance(state[key], dict):
                state = state[key]
                break
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not fit: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")


def run_export_onnx(args: argparse.Namespace) -> int:
    from lantern.backends.onnx_export import ensure_graphs
    from lantern.backends.onnx_runtime import ONNXBackend
    from lantern.config import gpt_preset
    from lantern.decoding import SamplingConfig, method_preset
    from lantern.decoding.loop import static_spec
    from lantern.models.drafter import Drafter
    from lantern.models.gpt import GPT

    avail = ONNXBackend.availability()
    if not avail.ok:
        print(f"export-onnx: onnx: {avail.reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        if args.images < 1:
            raise ValueError(f"--images {args.images} must be >= 1")
        overrides = {"drafting": args.tree} if args.tree else {}
        dcfg = method_preset(args.method, SamplingConfig(cfg_scale=args.cfg_scale), **overrides)
        ONNXBackend().check_dtype(args.dtype)
        torch.manual_seed(args.seed)
        target = GPT(gpt_preset(args.preset)).eval()
        drafter = Drafter(target.config).eval() if dcfg.speculative else None
        if args.checkpoint:
            load_weights(target, args.checkpoint)
        if drafter is not None and args.drafter_checkpoint:
            load_weights(drafter, args.drafter_checkpoint)
        if not args.checkpoint or (drafter is not None and not args.drafter_checkpoint):
            print("export-onnx: no checkpoint for every model: exporting random weights (fine for tests and "
                  "timing, useless for images)", file=sys.stderr)
        spec = static_spec(dcfg, target.config, args.images if not dcfg.speculative else 1, args.dtype)
        paths = ensure_graphs(target, drafter, spec, Path(args.out), force=args.force)
    except (ValueError, OSError) as e:
        print(f"export-onnx: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    import onnxruntime as ort

    for path in paths.values():  # every written graph must open in the runtime it is for
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    print(json.dumps({"spec": asdict(spec), "graphs": {k: str(v) for k, v in paths.items()}}, indent=1))
    return EXIT_OK


def main(argv: Optional[list[str]] = None) -> int:
    """Standalone entry (`python -m lantern.onnx_cli export-onnx ...`), the same as the lantern subcommand."""
    parser = argparse.ArgumentParser(prog="lantern")
    add_export_onnx_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
