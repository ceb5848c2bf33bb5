"""Options shared by several `lantern` commands, and what they mean: decoding and sampling flags, backend flags,
text-to-image prompts, and the plan a request runs (a named method, or auto's choice)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from lantern.backends import backend_class, registered, resolve_name
from lantern.cli.parsing import UsageError, number
from lantern.cli.profile import profile_costs
from lantern.cli.sampling_flags import add_sampling_options, sampling_from_args
from lantern.decoding.acceptance import FORMS, KINDS
from lantern.decoding.config import COUPLINGS, INITIAL_DRAFTS, METHODS, DecodeConfig, method_preset
from lantern.models.text import T5Conditioner, check_encoder_fits, read_prompts, require_transformers, t5_folder
from lantern.plan.candidates import RELAXED_METHODS
from lantern.plan.choose import MIN_SPEEDUP
from lantern.plan.validated import RELAXATION_FIELDS, allowed_relaxations, guarded


def add_decode_options(p: argparse.ArgumentParser) -> None:
    """Decoding flags shared by generate, eval and profile."""
    g = p.add_argument_group("decoding")
    g.add_argument("--method", choices=("auto", *METHODS), default="auto",
                   help="auto (default: the plan predicted fastest for this device, dtype and number of images, "
                        "lossless unless relaxation is allowed; see --allow-relaxed) | ar | eagle2 (dynamic tree, "
                        "exact) | lantern (dynamic, k=1000, delta=0.1) | lantern++ (57-node static tree, k=10, "
                        "lambda=3) | no drafter needed: sjd (Jacobi window, exact) | mc-sjd (Jacobi, Gumbel-coupled "
                        "drafts, exact) | mc-sjd-pac (mc-sjd verifying a small tree of more candidates at the window's first "
                        "positions, exact) | mc-sjd-relaxed (mc-sjd with bounded LANTERN++ relaxation, k=10, lambda=3); a "
                        "bundle's validated relaxation (shown by lantern info) replaces these settings at the sampling "
                        "it was validated at; elsewhere a relaxed method runs lossless unless --allow-relaxed")
    g.add_argument("--allow-relaxed", action="store_true",
                   help="relax where the bundle validated no relaxation for this sampling: auto may choose relaxed "
                        "(LANTERN, LANTERN++) plans, and a named relaxed method runs relaxed (the bundle's settings, "
                        "else the preset's, k at most 1/16 of the codebook); without it relaxation applies only at "
                        "the sampling it was validated at")
    g.add_argument("--min-speedup", type=number(float, 1),
                   help=f"auto keeps AR unless a plan is predicted at least this much faster (default {MIN_SPEEDUP}: "
                        f"a prediction within 20%% of the measured speed-up then still beats AR; hardware that times "
                        f"steadily can ask for less)")
    g.add_argument("--drafting", help="override: none | dynamic | jacobi | a tree preset | a .json file of paths")
    g.add_argument("--window", type=int, help="Jacobi: drafts verified after the last accepted token (default 16)")
    g.add_argument("--coupling", choices=COUPLINGS, help="Jacobi: none (SJD) | gumbel (MC-SJD)")
    g.add_argument("--branching", type=number(int, 1),
                   help="Jacobi: candidates verified per position at the window's first --branch-depth positions "
                        "(1: the plain window; mc-sjd-pac's default: docs/methods.md)")
    g.add_argument("--branch-depth", type=number(int, 1),
                   help="Jacobi, --branching > 1: the window's first positions whose every candidate branches")
    g.add_argument("--tail", type=number(int, 0),
                   help="Jacobi, --branching > 1: nodes of the window's own drafts after each branch's last one")
    g.add_argument("--fan", type=number(int, 0),
                   help="Jacobi: more candidates for the token after the last accepted one, after the --branching "
                        "ones, each verified alone (0: none; mc-sjd-pac's default: docs/methods.md)")
    g.add_argument("--initial", choices=INITIAL_DRAFTS,
                   help="Jacobi drafts at positions never predicted: above (default: the decided token one grid "
                        "row up, where there is one) | last (drawn from the last distribution)")
    g.add_argument("--acceptance", choices=KINDS, help="override the method's acceptance rule")
    g.add_argument("--k", type=number(int, 0), help="proximity neighbours for relaxed acceptance")
    g.add_argument("--delta", type=number(float, 0, 1), help="LANTERN bound, in [0, 1]")
    g.add_argument("--lam", type=number(float, 1), help="LANTERN++ bound, >= 1")
    g.add_argument("--relaxation", dest="form", choices=FORMS,
                   help="bounded (default: a fixed relaxed target per node, output within the recorded TV of the "
                        "target) | paper (LANTERN's own rule as its code runs it, distortion not bounded by delta)")
    g.add_argument("--batch", type=number(int, 1), help="images per static step (default 16): the engine's slots; "
                                                        "a finished image's slot takes the next image")
    add_sampling_options(g)


def add_backend_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("backend")
    g.add_argument("--backend", help="auto | cpu | cuda | ... (default: $LANTERN_BACKEND, else auto)")
    g.add_argument("--dtype", help="fp32 | bf16 | fp16, what the backend supports (default: its preferred one)")
    g.add_argument("--gaudi-config", help="hpu backend only: a gaudi_config.json (or its folder) whose autocast op "
                                          "lists the steps run under (default: $LANTERN_GAUDI_CONFIG; docs/gaudi.md)")
    g.add_argument("--fused-step", action="store_true",
                   help="backends that declare a fused step (`lantern backends` lists them): the whole decode step "
                        "as one graph (docs/backends.md#fused-step)")


def backend_options(args) -> dict:
    """Backend constructor options from the flags: --gaudi-config, which only the hpu backend takes, and
    --fused-step, which the backends that declare a fused step take (Backend.abilities)."""
    options = {}
    if args.gaudi_config or args.fused_step:
        name = resolve_name(args.backend)
        if args.gaudi_config and name != "hpu":
            raise UsageError(f"--gaudi-config is an option of the hpu backend; the backend here is {name!r}")
        if args.fused_step and not backend_class(name).abilities.fused_step:
            fusing = [n for n in sorted(registered()) if backend_class(n).abilities.fused_step]
            raise UsageError(f"--fused-step is an option of the backends that declare a fused step "
                             f"({', '.join(fusing)}); the backend here is {name!r}")
        options = {"gaudi_config": args.gaudi_config} if args.gaudi_config else {}
        if args.fused_step:
            options["fused_step"] = True
    return options


AUTO_CHOOSES = ("drafting", "acceptance", "k", "delta", "lam", "form", "window", "coupling",
                "initial", "branching", "branch_depth", "tail", "fan")  # flags auto decides


def check_method_flags(args) -> None:
    """Before any work: auto decides the drafting and acceptance itself; --allow-relaxed is auto's and the relaxed
    methods'; --min-speedup is auto's alone."""
    if args.method == "auto":
        given = [f"--{name.replace('_', '-')}" for name in AUTO_CHOOSES if getattr(args, name) is not None]
        if given:
            raise UsageError(f"--method auto chooses {', '.join(given)} itself; drop them or name a method "
                             f"(--method {' | '.join(METHODS)})")
    elif args.allow_relaxed and args.method not in RELAXED_METHODS:
        raise UsageError(f"--allow-relaxed is an option of --method auto and the relaxed methods "
                         f"({', '.join(RELAXED_METHODS)}); --method {args.method} is lossless")
    elif args.min_speedup is not None:
        raise UsageError(f"--min-speedup is an option of --method auto; --method {args.method} runs that method "
                         f"whatever its speed-up")


def named_decode(args, model) -> DecodeConfig:
    """A named method's preset with the flags given (model: a bundle, or a model family's folder); what runs of it
    is Pipeline.generate's to decide (lantern.plan.validated.guarded)."""
    overrides = {name: getattr(args, name) for name in AUTO_CHOOSES if getattr(args, name) is not None}
    return method_preset(args.method, sampling_from_args(args, model), **overrides)


def relaxation_allowed(args) -> bool:
    """Whether the command allows relaxation: --allow-relaxed, or relaxation settings named (--acceptance, --k,
    --delta, --lam, --form), which run as named."""
    return bool(args.allow_relaxed) or any(getattr(args, name) is not None for name in RELAXATION_FIELDS)


def named_relaxation(args, bundle):
    """(the decode config that runs, its relaxation or None) of a named method on a bundle: what Pipeline.generate
    runs for it (lantern.plan.validated.guarded), a warning where named settings bound nothing."""
    return guarded(named_decode(args, bundle), bundle.validations, bundle.target.config.vocab_size,
                   relaxation_allowed(args))


def relaxation_account(args, bundle) -> Optional[dict]:
    """The JSON's "relaxation": for a named relaxed method, what applied and why; for auto, per relaxed method
    whether it could run relaxed at this sampling and why; None for a lossless method."""
    if args.method == "auto":
        relaxations = allowed_relaxations(bundle.validations, sampling_from_args(args, bundle),
                                          bundle.target.config.vocab_size, args.allow_relaxed)
        return {m: r.to_dict() for m, r in relaxations.items()}
    return named_relaxation(args, bundle)[1]


def decode_plan(args, bundle, pipe, n_images: int, classes: Optional[list[int]] = None):
    """(the pipeline to run on, decode config, batch width, auto's choice or None) for this request (classes: its
    images' class ids in order, when known); auto (Pipeline.plan) may choose another mode's pipeline. A named
    method's config and --batch are checked by the generation that runs them (its engine), once."""
    if args.method != "auto":
        dcfg, relaxation = named_relaxation(args, bundle)
        for warning in (relaxation or {}).get("warnings", []):
            print(f"lantern: warning: this relaxation bounds nothing: {warning}", file=sys.stderr)
        return pipe, dcfg, args.batch, None
    profile = profile_costs(args.profile) if getattr(args, "profile", None) else None
    choice = pipe.plan(n_images, sampling_from_args(args, bundle), batch=args.batch,
                       allow_relaxed=args.allow_relaxed, profile=profile, classes=classes,
                       min_speedup=args.min_speedup)
    print(f"lantern: {choice.line()}", file=sys.stderr)
    return choice.pipeline, choice.decode, choice.width, choice


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    """`--prompt ... / --prompts-file FILE --t5 PATH`: text-to-image from prompts (lantern.models.text)."""
    g = p.add_argument_group("text-to-image (t2i bundles)")
    g.add_argument("--prompt", action="append", help="a prompt, --num-images images each (repeatable); replaces --classes")
    g.add_argument("--prompts-file", help="UTF-8 text file, one prompt a line (blank lines skipped)")
    g.add_argument("--t5", help="local T5 encoder folder (LlamaGen: flan-t5-xl; default: $LANTERN_T5); never "
                                "downloaded")


def wants_prompts(args) -> bool:
    return bool(args.prompt) or args.prompts_file is not None


def check_prompt_args(args) -> list[str]:
    """Before any work: the prompts (non-empty, UTF-8), the T5 folder (complete), the `transformers` extra."""
    prompts = read_prompts(args.prompt, args.prompts_file)
    t5_folder(args.t5)
    require_transformers()
    return prompts


def encode_prompts(args, bundle, prompts: list[str]):
    """The bundle's t2i condition for each prompt, (n, P, C), with LlamaGen's conventions."""
    cfg = bundle.target.config
    if cfg.model_type != "t2i":
        raise ValueError(f"--prompt needs a text-to-image bundle; {bundle.path} is {cfg.model_type} (use --classes)")
    encoder = T5Conditioner(args.t5, max_tokens=cfg.cls_token_num)
    check_encoder_fits(encoder, cfg)
    return encoder.encode(prompts)[0]
