"""`lantern generate`: images from class ids or prompts, with a bundle (default: the embedded model) or a
model-family folder (lantern.cli.family)."""
from __future__ import annotations

from pathlib import Path

from lantern.api import Pipeline
from lantern.backends import get_backend
from lantern.cli.family import cmd_generate_family
from lantern.cli.options import (add_backend_options, add_decode_options, add_prompt_options, backend_options,
                                 check_method_flags, check_prompt_args, decode_plan, encode_prompts,
                                 relaxation_account, relaxation_allowed, wants_prompts)
from lantern.cli.parsing import UsageError, number
from lantern.cli.profile import apply_profile
from lantern.engine import derive_seed
from lantern.engine.seeds import SEED_RANGE
from lantern.files.atomic_io import check_writable
from lantern.files.images import check_outputs, save_images
from lantern.bundle import load_bundle
from lantern.models.family import is_family_folder
from lantern.plan.backend_choice import pinned_backend


def add_arguments(g) -> None:
    g.add_argument("--model", help="bundle folder, or a transformers model folder of a supported family "
                                   "(docs/model-families.md) (default: the embedded model)")
    g.add_argument("--classes", type=int, nargs="+", default=[0, 1, 2, 3],
                   help="class ids, --num-images images each")
    g.add_argument("--num-images", type=number(int, 1), default=1,
                   help="images per class id or prompt, each from its own seed (default 1)")
    g.add_argument("--seed", type=number(int, *SEED_RANGE), default=0,
                   help="image i draws from its own seed derived from this one (image 0: this seed itself; the "
                        "JSON's 'seeds' and the file names give each): --seed <that> --classes <its class> "
                        "reproduces one image alone")
    g.add_argument("--out", default="out", help="folder for the PNGs and grid.png")
    g.add_argument("--scale", type=number(int, 1), default=4, help="upscale factor of the written PNGs, >= 1")
    g.add_argument("--no-images", action="store_true", help="tokens and stats only")
    g.add_argument("--drafter", help="Chameleon / Anole folders: LANTERN's Anole drafter folder (config.json + "
                                     "model.safetensors or pytorch_model.bin), for eagle2")
    g.add_argument("--vq", help="Chameleon / Anole folders: the folder with vqgan.yaml and vqgan.ckpt (default: "
                                "<model>/tokenizer, <model> or <model>/../tokenizer, where they are)")
    g.add_argument("--proximity", help="Chameleon / Anole folders: LANTERN's Anole proximity table "
                                       "(top_8191_indices.npy) for the relaxed methods (default: computed from the "
                                       "VQGAN's codebook)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--profile", help="hardware profile NAME or .toml FILE: its backend, dtype, threads, and for "
                                     "--method auto its calibration (auto then weighs that backend's modes only)")
    add_prompt_options(g)
    add_decode_options(g)
    add_backend_options(g)
    g.set_defaults(func=cmd_generate, show=print_generate)


def cmd_generate(args) -> dict:
    if is_family_folder(args.model):
        return cmd_generate_family(args)
    if args.vq is not None or args.drafter is not None or args.proximity is not None:
        raise UsageError("--vq, --drafter and --proximity are for Chameleon / Anole folders; a bundle carries its "
                         "own VQ model, drafter and proximity table")
    check_method_flags(args)
    prompts = check_prompt_args(args) if wants_prompts(args) else None
    apply_profile(args)  # a --profile supplies backend, dtype and threads
    # built once, here: an unknown or unavailable backend fails before any loading or writing
    backend = get_backend(args.backend, **backend_options(args))
    if not args.no_images:
        check_writable(Path(args.out), "--out", folder=True)
    bundle = load_bundle(args.model)
    if prompts is None and bundle.target.config.model_type == "t2i":
        raise UsageError(f"{args.model} is a text-to-image bundle: give --prompt or --prompts-file (and --t5)")
    pipe = Pipeline.from_bundle(bundle, backend=backend, dtype=args.dtype,
                                pinned=pinned_backend(args.backend) is not None)
    each = args.num_images  # images per class id or prompt, one after another
    classes = [c for c in args.classes for _ in range(each)]
    # checked once, before auto measures anything; generate takes them checked
    conditions = pipe.conditions(classes if prompts is None
                                 else encode_prompts(args, bundle, prompts).repeat_interleave(each, 0))
    seeds = [derive_seed(args.seed, i) for i in range(len(conditions))]  # each image's own seed
    kind = "class" if prompts is None else "prompt"
    labels = classes if prompts is None else [i // each for i in range(len(conditions))]  # its class, its prompt
    if not args.no_images:
        check_outputs(Path(args.out), image_names(kind, labels, seeds), bundle.vq.config.image_size, args.scale)
    pipe, dcfg, batch, choice = decode_plan(args, bundle, pipe, len(conditions), None if prompts else classes)
    result = pipe.generate(conditions, dcfg, seed=args.seed, progress=not args.json, batch=batch,
                           allow_relaxed=relaxation_allowed(args))
    paths, grid = [], None
    if not args.no_images:
        images = bundle.decode_images(result.tokens)
        paths, grid = save_images(images, Path(args.out), image_names(kind, labels, seeds), scale=args.scale)
    s = result.stats.summary()
    return {
        "backend": result.backend, "device": result.device, "dtype": result.dtype, "mode": args.method,
        "decode": dcfg.to_dict(), "seed": args.seed, "seeds": seeds,
        "classes": result.conditions if prompts is None else None, "prompts": prompts,
        "image_paths": paths, "grid_path": grid, "tokens": result.tokens.tolist(),
        "batch": s["batch"], "num_tokens": s["tokens"], "target_forwards": s["target_forwards"],
        "step_compression": s["step_compression"],
        "mean_accepted_length": s["mean_accepted_length"], "phase_seconds": s["phase_seconds"],
        "wall_seconds": s["wall_seconds"], "peak_memory_bytes": result.profile["memory"]["peak_bytes"],
        "memory": result.profile["memory"], "warmup_seconds": result.profile["warmup_s"], "stats": s,
        "plan": None if choice is None else {**choice.to_dict(), "measured_seconds": s["wall_seconds"]},
        "relaxation": relaxation_account(args, bundle),
    }


def image_names(kind: str, conditions, seeds: list[int]) -> list[str]:
    return [f"{i:03d}_{kind}{c}_seed{s}" for i, (c, s) in enumerate(zip(conditions, seeds))]


def print_generate(out: dict) -> None:
    st = out["stats"]
    print(f"{out['mode']} on {out['backend']} ({out['device']}, {out['dtype']}): {st['tokens']} tokens in "
          f"{st['wall_seconds']:.2f} s, {st['target_forwards']} target forwards, mean accepted length "
          f"{st['mean_accepted_length']:.2f}")
    if out["plan"]:
        p = out["plan"]
        print(f"auto ran {p['plan']} at {p['batch']} image(s) per step: predicted {p['predicted_seconds']:.2f} s "
              f"({p['predicted_speedup']:.2f}x AR's predicted {p['predicted_ar_seconds']:.2f} s), measured "
              f"{p['measured_seconds']:.2f} s")
    if out["grid_path"]:
        print(f"images: {len(out['image_paths'])} in {Path(out['grid_path']).parent}  grid: {out['grid_path']}")
