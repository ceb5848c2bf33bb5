"""`lantern` command line: generate, eval, backends, profile, train, info, export-onnx, serve.

Exit codes (lantern.exit_codes): 0 ok, 1 internal error (or a failed case or check), 2 bad usage or input,
3 backend unavailable, 130 stopped by Ctrl-C, 143 stopped by SIGTERM (docs/reliability.md).

With --json, a command prints exactly one JSON object on stdout (errors too: {"error": ..., "exit_code": ...}).
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Optional

from lantern.cli.parsing import (Parser, Stopped, UsageError, check_writable, expected_failure, number,
                              stopped_by_signals)
from lantern.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED_CASES, EXIT_INTERNAL, EXIT_OK, EXIT_UNAVAILABLE
from lantern.cli.profile import add_profile_commands
from lantern.engine.seeds import SEED_RANGE
from lantern.cli.train import add_info_command, add_train_commands


def add_decode_options(p: argparse.ArgumentParser) -> None:
    """Decoding flags shared by generate, eval and profile."""
    from lantern.decoding.acceptance import FORMS, KINDS
    from lantern.decoding.config import COUPLINGS, INITIAL_DRAFTS, METHODS
    from lantern.plan.choose import MIN_SPEEDUP
    g = p.add_argument_group("decoding")
    g.add_argument("--method", choices=("auto", *METHODS), default="auto",
                   help="auto (default: the plan predicted fastest for this device, dtype and number of images, "
                        "lossless unless relaxation is allowed; see --allow-relaxed) | ar | eagle2 (dynamic tree, "
                        "exact) | lantern (dynamic, k=1000, delta=0.1) | lantern++ (57-node static tree, k=10, "
                        "lambda=3) | no drafter needed: sjd (Jacobi window, exact) | mc-sjd (Jacobi, Gumbel-coupled "
                        "drafts, exact) | mc-sjd-relaxed (mc-sjd with bounded LANTERN++ relaxation, k=10, lambda=3); a "
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
    g.add_argument("--initial", choices=INITIAL_DRAFTS,
                   help="Jacobi drafts at positions never predicted: above (default: the decided token one grid "
                        "row up, where there is one) | last (drawn from the last distribution)")
    g.add_argument("--acceptance", choices=KINDS, help="override the method's acceptance rule")
    g.add_argument("--k", type=number(int, 0), help="proximity neighbours for relaxed acceptance")
    g.add_argument("--delta", type=number(float, 0, 1), help="LANTERN bound, in [0, 1]")
    g.add_argument("--lam", type=number(float, 1), help="LANTERN++ bound, >= 1")
    g.add_argument("--relaxation", dest="form", choices=FORMS,
                   help="bounded (default: a fixed relaxed target per node, output within the recorded TV of the "
                        "target) | paper (the published per-candidate rules, distortion not bounded by delta)")
    g.add_argument("--batch", type=number(int, 1), help="images per static step (default 16): the engine's slots; "
                                                        "a finished image's slot takes the next image")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (default: sampling)")
    g.add_argument("--temperature", type=number(float, 0, low_open=True), help="> 0 (default: the model's)")
    g.add_argument("--top-k", type=number(int, 0), help="0 = off (default: the model's)")
    g.add_argument("--top-p", type=number(float, 0, 1, low_open=True), help="in (0, 1], 1 = off (default: the model's)")
    g.add_argument("--cfg-scale", type=number(float, 1),
                   help="classifier-free guidance scale, >= 1, 1 = off (default: the model's)")


def add_backend_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("backend")
    g.add_argument("--backend", help="auto | cpu | cuda | ... (default: $LANTERN_BACKEND, else auto)")
    g.add_argument("--dtype", help="fp32 | bf16 | fp16, what the backend supports (default: its preferred one)")
    g.add_argument("--gaudi-config", help="hpu backend only: a gaudi_config.json (or its folder) whose autocast op "
                                          "lists the steps run under (default: $LANTERN_GAUDI_CONFIG; docs/gaudi.md)")
    g.add_argument("--fused-step", action="store_true",
                   help=f"graph backends ({', '.join(FUSING_BACKENDS)}): the whole decode step as one graph "
                        "(docs/backends.md#fused-step)")


FUSING_BACKENDS = ("cpu-graph", "cuda-graph", "hpu")  # backends that take fused_step


def backend_options(args) -> dict:
    """Backend constructor options from the flags: --gaudi-config, which only the hpu backend takes, and
    --fused-step, which graph backends take."""
    from lantern.backends import resolve_name
    options = {}
    if args.gaudi_config or args.fused_step:
        name = resolve_name(args.backend)
        if args.gaudi_config and name != "hpu":
            raise UsageError(f"--gaudi-config is an option of the hpu backend; the backend here is {name!r}")
        if args.fused_step and name not in FUSING_BACKENDS:
            raise UsageError(f"--fused-step is an option of the graph backends ({', '.join(FUSING_BACKENDS)}); "
                             f"the backend here is {name!r}")
        options = {"gaudi_config": args.gaudi_config} if args.gaudi_config else {}
        if args.fused_step:
            options["fused_step"] = True
    return options


AUTO_CHOOSES = ("drafting", "acceptance", "k", "delta", "lam", "form", "window", "coupling",
                "initial")  # flags auto decides


def sampling_from_args(args, bundle):
    """Sampling flags left out take the bundle's validated defaults."""
    from lantern.decoding.sampling import SamplingConfig
    model_defaults = bundle.default_sampling
    chosen = {k: getattr(args, k) for k in ("cfg_scale", "temperature", "top_k", "top_p")}
    return SamplingConfig(greedy=args.greedy, **{k: model_defaults[k] if v is None else v for k, v in chosen.items()})


def check_method_flags(args) -> None:
    """Before any work: auto decides the drafting and acceptance itself; --allow-relaxed is auto's and the relaxed
    methods'; --min-speedup is auto's alone."""
    from lantern.decoding.config import METHODS
    from lantern.plan.candidates import RELAXED_METHODS
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


def decode_config_from_args(args, model):
    """The decode config of a named method (model: a bundle, or a model family's folder, which validates no
    relaxation and runs a named relaxed method at its preset)."""
    if not hasattr(model, "validations"):
        from lantern.decoding.config import method_preset
        overrides = {name: getattr(args, name) for name in AUTO_CHOOSES if getattr(args, name) is not None}
        return method_preset(args.method, sampling_from_args(args, model), **overrides)
    return named_relaxation(args, model)[0]


def named_relaxation(args, bundle):
    """(decode config, its relaxation or None) of a named method on a bundle: a relaxed method's k / delta /
    lambda / form left out take the bundle's relaxation validated at this sampling, else (lossless) exact
    acceptance unless --allow-relaxed (lantern.plan.validated); relaxation flags named run as named, a warning
    where they bound nothing."""
    from lantern.plan.validated import named_config
    overrides = {name: getattr(args, name) for name in AUTO_CHOOSES if getattr(args, name) is not None}
    return named_config(args.method, sampling_from_args(args, bundle), overrides, bundle.validations,
                        bundle.target.config.vocab_size, bool(getattr(args, "allow_relaxed", False)))


def auto_relaxation(args, bundle, sampling) -> dict:
    """Per relaxed method, whether auto could run it relaxed at this sampling and why (the JSON's account)."""
    from lantern.plan.validated import allowed_relaxations
    return {m: r.to_dict() for m, r in allowed_relaxations(bundle.validations, sampling,
                                                           bundle.target.config.vocab_size,
                                                           args.allow_relaxed).items()}


def decode_plan(args, bundle, pipe, n_images: int, classes: Optional[list[int]] = None):
    """(decode config, batch width, the auto choice or None) for this request (classes: its images' class ids in
    order, when known)."""
    if args.method != "auto":
        dcfg, relaxation = named_relaxation(args, bundle)
        for warning in (relaxation or {}).get("warnings", []):
            print(f"lantern: warning: this relaxation bounds nothing: {warning}", file=sys.stderr)
        return dcfg, pipe.check(dcfg, args.batch), None
    from lantern.plan.backend_choice import choose_backend, pinned_backend
    from lantern.cli.profile import profile_costs
    if pinned_backend(args.backend) is None and not getattr(args, "profile", None):  # auto weighs every mode too
        choice = choose_backend(lambda name, dtype, **options: pipe
                                if (name, dtype, options) == (pipe.backend.name, pipe.dtype, {}) else
                                type(pipe).from_bundle(bundle, backend=name, dtype=dtype, **options), n_images,
                                sampling_from_args(args, bundle), batch=args.batch, allow_relaxed=args.allow_relaxed,
                                validated=bundle.validations, shipped_records=bundle.acceptance_records,
                                classes=classes, min_speedup=args.min_speedup, dtype=args.dtype)
        print(f"lantern: {choice.summary()}", file=sys.stderr)
        return choice.choice.decode, choice.choice.width, choice
    profile = profile_costs(args.profile) if getattr(args, "profile", None) else None
    choice = pipe.plan(n_images, sampling_from_args(args, bundle), batch=args.batch,
                       allow_relaxed=args.allow_relaxed, profile=profile, classes=classes,
                       min_speedup=args.min_speedup)
    print(f"lantern: {choice.summary()}", file=sys.stderr)
    return choice.decode, choice.width, choice


def cmd_generate(args) -> dict:
    from lantern.api import Pipeline, check_classes
    from lantern.backends import get_backend
    from lantern.bundle import load_bundle
    from lantern.engine import derive_seed
    from lantern.cli.family import cmd_generate_family, is_family_folder
    from lantern.files.images import check_outputs, save_images
    from lantern.cli.profile import apply_profile
    from lantern.cli.prompts import check_prompt_args, encode_prompts, wants_prompts

    if is_family_folder(args.model):
        return cmd_generate_family(args)
    if args.vq is not None or args.drafter is not None or args.proximity is not None:
        raise UsageError("--vq, --drafter and --proximity are for Chameleon / Anole folders; a bundle carries its "
                         "own VQ model, drafter and proximity table")
    check_method_flags(args)
    prompts = check_prompt_args(args) if wants_prompts(args) else None
    apply_profile(args)  # a --profile supplies backend, dtype, threads and the tree tuned for this batch width
    options = backend_options(args)
    get_backend(args.backend, **options)  # an unknown or unavailable backend fails before any loading or writing
    if not args.no_images:
        check_writable(Path(args.out), "--out", folder=True)
    bundle = load_bundle(args.model)
    if prompts is None and bundle.target.config.model_type == "t2i":
        raise UsageError(f"{args.model} is a text-to-image bundle: give --prompt or --prompts-file (and --t5)")
    if prompts is None:
        check_classes(args.classes, bundle.target.config.num_classes)  # before auto measures anything
    conditions = args.classes if prompts is None else encode_prompts(args, bundle, prompts)
    seeds = [derive_seed(args.seed, i) for i in range(len(conditions))]  # each image's own seed
    kind = "class" if prompts is None else "prompt"
    if not args.no_images:
        names = image_names(kind, args.classes if prompts is None else range(len(seeds)), seeds)
        check_outputs(Path(args.out), names, bundle.vq.config.image_size, args.scale)
    pipe = Pipeline.from_bundle(bundle, backend=args.backend, dtype=args.dtype, **options)
    dcfg, batch, choice = decode_plan(args, bundle, pipe, len(conditions), None if prompts else list(args.classes))
    pipe = getattr(choice, "pipeline", pipe)  # auto may have chosen another backend
    result = pipe.generate(conditions, dcfg, seed=args.seed, progress=not args.json, batch=batch)
    paths, grid = [], None
    if not args.no_images:
        images = bundle.decode_images(result.tokens)
        paths, grid = save_images(images, Path(args.out), image_names(kind, result.conditions, seeds),
                                  scale=args.scale)
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


def relaxation_account(args, bundle) -> Optional[dict]:
    """The JSON's "relaxation": for a named relaxed method, what applied and why; for auto, per relaxed method
    whether it could run relaxed at this sampling and why; None for a lossless method."""
    if args.method == "auto":
        return auto_relaxation(args, bundle, sampling_from_args(args, bundle))
    return named_relaxation(args, bundle)[1]


def image_names(kind: str, conditions, seeds: list[int]) -> list[str]:
    return [f"{i:03d}_{kind}{c}_seed{s}" for i, (c, s) in enumerate(zip(conditions, seeds))]


def cmd_eval(args) -> dict:
    """Generate n images per class with the chosen method and backend; accuracy and Frechet distance against
    held-out real images, and the same figures for real images as the floor."""
    from lantern.api import Pipeline, check_classes
    from lantern.backends import get_backend
    from lantern.bundle import load_bundle
    from lantern.embedded.evaluate import EVAL_CHUNK, evaluate
    from lantern.extras import require

    require("sklearn", "lantern eval (the held-out digits it scores against)")
    check_method_flags(args)
    options = backend_options(args)
    get_backend(args.backend, **options)
    bundle = load_bundle(args.model)
    if bundle.evaluator is None:
        raise UsageError(f"bundle {bundle.path} has no evaluator.safetensors; `lantern eval` needs one")
    pipe = Pipeline.from_bundle(bundle, backend=args.backend, dtype=args.dtype, **options)
    num_classes = bundle.target.config.num_classes
    n_classes = len(check_classes(args.classes, num_classes)) if args.classes else num_classes
    if n_classes * args.n_per_class < 2:
        raise UsageError(f"eval needs at least 2 images (a Frechet distance needs their covariance); --classes "
                         f"{' '.join(map(str, args.classes or []))} with --n-per-class {args.n_per_class} makes "
                         f"{n_classes * args.n_per_class}: raise --n-per-class or name more --classes")
    last_seed = args.seed + -(-n_classes * args.n_per_class // EVAL_CHUNK) - 1  # each chunk: the next seed
    if last_seed > SEED_RANGE[1]:
        raise UsageError(f"--seed {args.seed}: eval seeds its chunks {args.seed}..{last_seed}, past the generator's "
                         f"range; allowed: an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1] - (last_seed - args.seed)}]")
    dcfg, batch, choice = decode_plan(args, bundle, pipe, min(n_classes * args.n_per_class, EVAL_CHUNK))
    pipe = getattr(choice, "pipeline", pipe)  # auto may have chosen another backend
    stats = []
    from tqdm import tqdm
    bar = tqdm(total=n_classes * args.n_per_class, desc="eval", unit="image", file=sys.stderr)

    def generate_fn(class_ids, seed):
        result = pipe.generate(class_ids.tolist(), dcfg, seed=seed, batch=batch)
        stats.append(result.stats.summary())
        bar.update(len(class_ids))
        return result.tokens

    out = evaluate(bundle, generate_fn, classes=args.classes, n_per_class=args.n_per_class, seed=args.seed)
    bar.close()
    steps = sum(s["verify_steps"] for s in stats)
    out.update(mode=args.method, decode=dcfg.to_dict(), plan=None if choice is None else choice.to_dict(),
               relaxation=relaxation_account(args, bundle),
               backend=pipe.backend.name, dtype=pipe.dtype, wall_seconds=sum(s["wall_seconds"] for s in stats),
               mean_accepted_length=(sum(s["mean_accepted_length"] * s["verify_steps"] for s in stats) / steps
                                     if steps else 1.0))
    return out


def print_eval(out: dict) -> None:
    g, r = out["generated"], out["real_train_reference"]
    mode = out["mode"] if out["plan"] is None else f"auto ({out['plan']['plan']})"
    print(f"{mode} on {out['backend']} ({out['dtype']}): class accuracy {g['class_accuracy']:.3f}, Frechet "
          f"distance {g['frechet_distance']:.2f} over {g['n']} images; mean accepted length "
          f"{out['mean_accepted_length']:.2f}, {out['wall_seconds']:.1f} s")
    print(f"real images (floor): class accuracy {r['class_accuracy']:.3f}, Frechet distance {r['frechet_distance']:.2f}")


def cmd_backends(args) -> dict:
    from lantern.backends import backend_class, registered, resolve_name
    from lantern.backends.base import describe
    if args.check:
        from lantern.backends.conformance import check_backend
        report = check_backend(args.check).to_dict()
        failed = not report["passed"]
        return {**report, "exit_code": EXIT_FAILED_CASES if failed else EXIT_OK if report["available"]
                else EXIT_UNAVAILABLE}
    rows = []
    for name in sorted(registered()):
        try:
            rows.append(describe(backend_class(name)))
        except Exception as e:  # a broken third-party backend must not hide the others
            rows.append({"name": name, "available": False, "reason": f"failed to load: {e}"})
    # resolving the selection ($LANTERN_BACKEND or auto) fails loudly on a bad name, as every command does
    return {"backends": rows, "selected": resolve_name(None)}


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


def print_backends(out: dict) -> None:
    if "checks" in out:
        for check in out["checks"]:
            print(f"{check['status'].upper():<5} {check['name']}: {check['message']}")
        verdict = ("unavailable here: nothing else was checked" if not out["available"] and out["passed"]
                   else "conforms" if out["passed"] else "does NOT conform")
        print(f"{out['backend']}: {verdict}")
        return
    for row in out["backends"]:
        if row["available"]:
            print(f"{row['name']:<12} available    device={row['device']} dtypes={','.join(row['dtypes'])}")
        else:
            print(f"{row['name']:<12} unavailable: {row['reason']}")
    print(f"selected ($LANTERN_BACKEND or auto): {out['selected']}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lantern", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate images (default model: the embedded bundle)")
    g.add_argument("--model", help="bundle folder, or a transformers model folder of a supported family "
                                   "(docs/model-families.md) (default: the embedded model)")
    g.add_argument("--classes", type=int, nargs="+", default=[0, 1, 2, 3], help="class ids, one image each")
    g.add_argument("--num-images", type=number(int, 1), default=1,
                   help="model-family folders: images per prompt (default 1)")
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
    g.add_argument("--profile", help="hardware profile NAME or .toml FILE: its backend, dtype, threads, the tree "
                                     "tuned for this batch width, and for --method auto its calibration")
    from lantern.cli.prompts import add_prompt_options
    add_prompt_options(g)
    add_decode_options(g)
    add_backend_options(g)
    g.set_defaults(func=cmd_generate, show=print_generate)

    e = sub.add_parser("eval", help="class accuracy and Frechet distance of generated images")
    e.add_argument("--model", help="bundle folder (default: the embedded model)")
    e.add_argument("--classes", type=int, nargs="+", help="class ids (default: all)")
    e.add_argument("--n-per-class", type=number(int, 1), default=10)
    e.add_argument("--seed", type=number(int, *SEED_RANGE), default=0)
    e.add_argument("--json", action="store_true")
    add_decode_options(e)
    add_backend_options(e)
    e.set_defaults(func=cmd_eval, show=print_eval)

    b = sub.add_parser("backends", help="list backends: available or why not, device, dtypes")
    b.add_argument("--check", metavar="NAME", help="run the conformance kit (lantern.backends.conformance) on "
                                                   "backend NAME: exit 0 if it conforms, 1 if a check fails, "
                                                   "3 if it is unavailable here")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_backends, show=print_backends)

    add_profile_commands(sub)
    add_train_commands(sub)
    add_info_command(sub)
    from lantern.cli.export_onnx import add_export_onnx_command
    add_export_onnx_command(sub)
    from lantern.cli.import_checkpoints import add_import_command
    add_import_command(sub)
    from lantern.cli.serve import add_serve_command
    add_serve_command(sub)
    return parser


def main(argv=None) -> int:
    from lantern.backends import BackendUnavailable
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return _fail(str(e), EXIT_BAD_INPUT, "--json" in argv)
    as_json = getattr(args, "json", False)
    try:
        with stopped_by_signals():
            out = args.func(args)
    except Stopped as e:
        return _fail(str(e), e.code, as_json)
    except BackendUnavailable as e:
        return _fail(str(e), EXIT_UNAVAILABLE, as_json)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e), EXIT_BAD_INPUT, as_json)
    except Exception as e:  # noqa: BLE001  anything else is our bug: say so, with the trace on stderr
        expected = expected_failure(e, args)
        if expected:
            return _fail(expected, EXIT_BAD_INPUT, as_json)
        traceback.print_exc()
        return _fail(f"internal error: {e}", EXIT_INTERNAL, as_json)
    if isinstance(out, int):  # the command printed its own output
        return out
    if as_json:
        print(json.dumps(out))
    else:
        args.show(out)
    return out.get("exit_code", EXIT_OK)


def _fail(message: str, code: int, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"error": message, "exit_code": code}))
    print(f"lantern: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
