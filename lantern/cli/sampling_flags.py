"""The sampling flags (`--greedy`, `--temperature`, `--top-k`, `--top-p`, `--cfg-scale`) of the commands that
generate or decide for a sampling setting, and the setting they name."""
from __future__ import annotations

from lantern.cli.parsing import number
from lantern.decoding.sampling import SamplingConfig


def add_sampling_options(g) -> None:
    """The flags, on a parser or an argument group."""
    g.add_argument("--greedy", action="store_true", help="argmax decoding (default: sampling)")
    g.add_argument("--temperature", type=number(float, 0, low_open=True), help="> 0 (default: the model's)")
    g.add_argument("--top-k", type=number(int, 0), help="0 = off (default: the model's)")
    g.add_argument("--top-p", type=number(float, 0, 1, low_open=True), help="in (0, 1], 1 = off (default: the model's)")
    g.add_argument("--cfg-scale", type=number(float, 1),
                   help="classifier-free guidance scale, >= 1, 1 = off (default: the model's)")


def sampling_from_args(args, bundle) -> SamplingConfig:
    """Sampling flags left out take the bundle's validated defaults."""
    model_defaults = bundle.default_sampling
    chosen = {k: getattr(args, k) for k in ("cfg_scale", "temperature", "top_k", "top_p")}
    return SamplingConfig(greedy=args.greedy, **{k: model_defaults[k] if v is None else v for k, v in chosen.items()})
