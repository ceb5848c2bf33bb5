"""`lantern generate --model <folder> --prompt ...` for model-family folders (transformers model folders,
lantern.models.family). Every input is checked before weights are loaded."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from lantern.api import Pipeline
from lantern.backends import get_backend
from lantern.cli.options import backend_options, check_method_flags, named_decode, sampling_from_args
from lantern.cli.parsing import UsageError
from lantern.decoding.stats import GenerationStats
from lantern.files.atomic_io import check_writable
from lantern.files.images import save_images
from lantern.files.reading import read_json_object
from lantern.models.anole_drafter import check_anole_drafter, read_anole_drafter
from lantern.models.chameleon import image_vocabulary, read_lantern_table
from lantern.models.family import check_family, load_family
from lantern.models.folders import FolderInfo
from lantern.models.proximity import DEFAULT_K
from lantern.models.text import read_prompts

RELAXED = ("lantern", "lantern++", "mc-sjd-relaxed")  # methods that read a proximity table of the VQ codebook


def needs_vq(args) -> bool:
    """Whether this request needs the model's VQ: to write images, or (Chameleon) for the codebook's proximity
    table that relaxed acceptance reads when no --proximity table is given."""
    return not args.no_images or (args.method in RELAXED and args.proximity is None)


def check_family_request(args) -> tuple[FolderInfo, list[str]]:
    """Everything a family generation needs, checked before loading: returns the folder's facts and the prompts."""
    info = check_family(args.model, args.vq, need_vq=needs_vq(args))
    prompts = read_prompts(args.prompt, args.prompts_file)
    if not prompts:
        raise UsageError(f"{args.model} is a {info.family} model: it generates from --prompt TEXT (repeatable) or "
                         f"--prompts-file FILE")
    if args.t5:
        raise UsageError(f"--t5 encodes prompts for LlamaGen t2i bundles; a {info.family} folder uses its own "
                         f"tokenizer")
    if args.allow_relaxed:
        raise UsageError(f"--allow-relaxed: no relaxation is validated for {info.family} models, so auto runs "
                         f"lossless plans only; name a relaxed method (--method mc-sjd-relaxed, ...) to run one")
    if args.profile:
        raise UsageError("--profile applies to LlamaGen bundles; leave it out for a model-family folder")
    if args.drafter is not None:
        if info.family != "chameleon":
            raise UsageError(f"--drafter takes LANTERN's Anole drafters, for Chameleon folders; {args.model} is a "
                             f"{info.family} model")
        from transformers import ChameleonConfig  # the families extra
        check_anole_drafter(Path(args.drafter), ChameleonConfig.from_pretrained(args.model))
    if args.proximity is not None and info.family != "chameleon":
        raise UsageError(f"--proximity takes LANTERN's Anole table, for Chameleon folders; {args.model} is a "
                         f"{info.family} model")
    if args.proximity is not None and args.method not in RELAXED:
        raise UsageError(f"--proximity is read by the relaxed methods ({', '.join(RELAXED)}); --method "
                         f"{args.method} does not read it")
    get_backend(args.backend, **backend_options(args)).check_family(info.family)
    if not args.no_images:
        check_writable(Path(args.out), "--out", folder=True)
    return info, prompts


def cmd_generate_family(args) -> dict:
    """--num-images images of each prompt; prompts of one token length share a pipeline (one static shape)."""
    check_method_flags(args)
    info, prompts = check_family_request(args)
    lantern_table = read_family_table(args) if args.proximity is not None else None
    family = load_family(args.model, args.vq, need_vq=needs_vq(args))
    drafter = None
    if args.drafter is not None:
        drafter = read_anole_drafter(Path(args.drafter), family.model)
    rows = [family.prompt_rows(p).expand(args.num_images, -1).contiguous() for p in prompts]
    for i, r in enumerate(rows):  # each prompt's memory is predicted before its first runner (Pipeline.runner)
        info.check_prompt_tokens(r.shape[1], f"prompt {i + 1} ({prompts[i][:40]!r}, {r.shape[1]} tokens)")
    auto = args.method == "auto"
    dcfg = None if auto else named_decode(args, family)  # its pipelines carry no bundle's record: run as named
    table = getattr(family, "proximity_table", None)  # Chameleon: from its VQGAN's codebook
    proximity = None
    if dcfg is not None and dcfg.acceptance != "exact":
        proximity = lantern_table if lantern_table is not None else table() if table is not None else None
    pipes: dict = {}

    def pipeline(length: int) -> Pipeline:  # one per prompt length (static prefix)
        if length not in pipes:
            pipes[length] = Pipeline(family.target(length), drafter, proximity, backend=args.backend, dtype=args.dtype,
                                     **backend_options(args))
        return pipes[length]
    choice, batch = None, args.batch
    if auto:  # on the backend given, lossless plans only, measured on the first length's prompts; run by every prompt
        same = torch.cat([r for r in rows if r.shape[1] == rows[0].shape[1]])  # (n, P): the first length's rows
        choice = pipeline(same.shape[1]).plan(len(rows) * args.num_images, sampling_from_args(args, family),
                                              batch=args.batch, progress=not args.json, prompts=same,
                                              min_speedup=args.min_speedup)
        print(f"lantern: {choice.line()}", file=sys.stderr)
        dcfg, batch = choice.decode, choice.width
    tokens, stats, result = [], GenerationStats(), None
    for r in rows:
        pipe = pipeline(r.shape[1])
        result = pipe.generate(r, dcfg, seed=args.seed, progress=not args.json, batch=pipe.check(dcfg, batch))
        tokens.append(result.tokens)
        stats.merge(result.stats)
    tokens = torch.cat(tokens)
    paths, grid = [], None
    if not args.no_images:
        images = family.decode_images(tokens)
        names = [f"{i:03d}_prompt{i // args.num_images}_seed{args.seed}" for i in range(len(images))]
        paths, grid = save_images(images, Path(args.out), names, scale=args.scale)
    s = stats.summary()
    return {
        "backend": result.backend, "device": result.device, "dtype": result.dtype, "mode": args.method,
        "family": family.family, "prompts": prompts, "prompt_tokens": [r.shape[1] for r in rows],
        "decode": dcfg.to_dict(), "seed": args.seed, "image_paths": paths, "grid_path": grid,
        "tokens": tokens.tolist(), "batch": s["batch"], "num_tokens": s["tokens"],
        "target_forwards": s["target_forwards"], "step_compression": s["step_compression"],
        "mean_accepted_length": s["mean_accepted_length"], "phase_seconds": s["phase_seconds"],
        "wall_seconds": s["wall_seconds"], "peak_memory_bytes": result.profile["memory"]["peak_bytes"],
        "memory": result.profile["memory"], "warmup_seconds": result.profile["warmup_s"], "stats": s,
        "plan": None if choice is None else {**choice.to_dict(), "why": choice.summary(),
                                             "measured_seconds": s["wall_seconds"]},
    }


def read_family_table(args):
    """--proximity: LANTERN's Anole table in code order (lantern.models.chameleon.read_lantern_table), read against
    the folder's vocabulary map before any weights are loaded."""
    cfg = read_json_object(Path(args.model) / "config.json")
    return read_lantern_table(args.proximity, image_vocabulary(cfg["vocabulary_map"]), DEFAULT_K)
