"""The sampling settings the benchmarks report side by side: the bundle's own, and the one LlamaGen (and LANTERN's
class-to-image experiments) sample at, over the whole vocabulary with CFG 4.0."""
from __future__ import annotations

from lantern.decoding.sampling import SamplingConfig

LLAMAGEN_C2I = dict(temperature=1.0, top_k=0, top_p=1.0, cfg_scale=4.0)  # LlamaGen's sample_c2i defaults
NAMES = ("bundle", "llamagen-c2i")


def sampling_settings(bundle_sampling: dict, names=NAMES) -> dict[str, SamplingConfig]:
    """name -> its SamplingConfig; bundle_sampling: the bundle's default sampling (Bundle.default_sampling)."""
    known = {"bundle": bundle_sampling, "llamagen-c2i": LLAMAGEN_C2I}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown sampling setting {unknown[0]!r}; allowed: {', '.join(known)}")
    return {n: SamplingConfig(**known[n]) for n in names}


def describe(sampling: SamplingConfig) -> str:
    top_k = "whole vocabulary" if sampling.top_k == 0 else f"top-k {sampling.top_k}"
    return f"{top_k}, CFG {sampling.cfg_scale:g}" + (f", top-p {sampling.top_p:g}" if sampling.top_p < 1 else "")
