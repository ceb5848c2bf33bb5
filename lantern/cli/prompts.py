"""`lantern generate --prompt ... / --prompts-file FILE --t5 PATH`: text-to-image from prompts (lantern.models.text)."""
from __future__ import annotations

import argparse


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("text-to-image (t2i bundles)")
    g.add_argument("--prompt", action="append", help="a prompt, one image each (repeatable); replaces --classes")
    g.add_argument("--prompts-file", help="UTF-8 text file, one prompt a line (blank lines skipped)")
    g.add_argument("--t5", help="local T5 encoder folder (LlamaGen: flan-t5-xl; default: $LANTERN_T5); never "
                                "downloaded")


def wants_prompts(args) -> bool:
    return bool(args.prompt) or args.prompts_file is not None


def check_prompt_args(args) -> list[str]:
    """Before any work: the prompts (non-empty, UTF-8), the T5 folder (complete), the `transformers` extra."""
    from lantern.models.text import read_prompts, require_transformers, t5_folder
    prompts = read_prompts(args.prompt, args.prompts_file)
    t5_folder(args.t5)
    require_transformers()
    return prompts


def encode_prompts(args, bundle, prompts: list[str]):
    """The bundle's t2i condition for each prompt, (n, P, C), with LlamaGen's conventions."""
    from lantern.models.text import T5Conditioner, check_encoder_fits
    cfg = bundle.target.config
    if cfg.model_type != "t2i":
        raise ValueError(f"--prompt needs a text-to-image bundle; {bundle.path} is {cfg.model_type} (use --classes)")
    encoder = T5Conditioner(args.t5, max_tokens=cfg.cls_token_num)
    check_encoder_fits(encoder, cfg)
    return encoder.encode(prompts)[0]
