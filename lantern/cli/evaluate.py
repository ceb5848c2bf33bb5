"""`lantern eval`: class accuracy and Frechet distance of generated images, against held-out real images."""
from __future__ import annotations

import sys

from tqdm import tqdm

from lantern.api import Pipeline, check_classes
from lantern.backends import get_backend
from lantern.cli.options import (add_backend_options, add_decode_options, backend_options, check_method_flags,
                                 decode_plan, relaxation_account, relaxation_allowed)
from lantern.cli.parsing import UsageError, number
from lantern.embedded.evaluate import EVAL_CHUNK, evaluate
from lantern.engine.seeds import SEED_RANGE
from lantern.extras import require
from lantern.bundle import load_bundle


def add_arguments(e) -> None:
    e.add_argument("--model", help="bundle folder (default: the embedded model)")
    e.add_argument("--classes", type=int, nargs="+", help="class ids (default: all)")
    e.add_argument("--n-per-class", type=number(int, 1), default=10)
    e.add_argument("--seed", type=number(int, *SEED_RANGE), default=0)
    e.add_argument("--json", action="store_true")
    add_decode_options(e)
    add_backend_options(e)
    e.set_defaults(func=cmd_eval, show=print_eval)


def cmd_eval(args) -> dict:
    """Generate n images per class with the chosen method and backend; accuracy and Frechet distance against
    held-out real images, and the same figures for real images as the floor."""
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
    pipe, dcfg, batch, choice = decode_plan(args, bundle, pipe, min(n_classes * args.n_per_class, EVAL_CHUNK))
    stats = []
    bar = tqdm(total=n_classes * args.n_per_class, desc="eval", unit="image", file=sys.stderr)

    def generate_fn(class_ids, seed):
        result = pipe.generate(class_ids.tolist(), dcfg, seed=seed, batch=batch,
                               allow_relaxed=relaxation_allowed(args))
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
    print(f"real images (floor): class accuracy {r['class_accuracy']:.3f}, "
          f"Frechet distance {r['frechet_distance']:.2f}")
