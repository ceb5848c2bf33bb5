"""Where the measured models come from, recorded honestly in every results file.

    auto            the embedded default bundle if this lantern has one, else random:GPT-small
    bundle[:PATH]   a trained bundle (lantern.bundle.load_bundle)
    random:PRESET   a deterministic random target of a GPT preset (lantern.models.config.GPT_PRESETS) with a random
                    drafter and a proximity table from a random codebook. Timing is that of the real shapes,
                    but acceptance is not a trained model's: exact acceptance (EAGLE-2) gives tau about 1, while
                    LANTERN's and LANTERN++'s relaxed rules accept far more than they would on a trained model,
                    because a random target's distributions are almost flat.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from lantern.bundle import DEFAULT_BUNDLE, load_bundle
from lantern.models.config import gpt_preset
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT
from lantern.models.proximity import build_proximity_table

DEFAULT_RANDOM = "GPT-small"
RANDOM_CFG_SCALE = 4.0  # LlamaGen's class-conditional default
RANDOM_PROXIMITY_K = 64  # neighbours kept per code (LANTERN++ uses k = 10)


@dataclass
class ModelSource:
    target: torch.nn.Module
    drafter: Optional[torch.nn.Module]
    proximity: Optional[torch.Tensor]
    default_cfg_scale: float
    info: dict = field(default_factory=dict)  # what the results file records
    relaxation: dict = field(default_factory=dict)  # a bundle's validated relaxations (Bundle.validations)
    acceptance_records: dict = field(default_factory=dict)  # by dtype (lantern.plan.acceptance_records)


def load_source(spec: str = "auto") -> ModelSource:
    if spec == "auto":
        spec = "bundle" if (DEFAULT_BUNDLE / "config.json").is_file() else f"random:{DEFAULT_RANDOM}"
    kind, _, arg = spec.partition(":")
    if kind == "bundle":
        return _bundle_source(arg or None)
    if kind == "random":
        return random_source(arg or DEFAULT_RANDOM)
    raise ValueError(f"model source {spec!r} is not one of: auto, bundle, bundle:PATH, random:PRESET")


def _bundle_source(path: Optional[str]) -> ModelSource:
    b = load_bundle(path)
    # the name is a valid source spec, which reloads exactly this bundle; the embedded one is named
    # "bundle", never by the folder it happens to be installed in (its files' hashes say which model it was)
    info = {"kind": "bundle", "name": f"bundle:{path}" if path else "bundle", "config": b.target.config.to_dict(),
            "has_drafter": b.drafter is not None, "has_proximity": b.proximity is not None,
            "manifest_files": b.manifest.get("files", {}),
            "note": "trained bundle: acceptance and speed-ups are the model's own"}
    return ModelSource(b.target, b.drafter, b.proximity, b.default_cfg_scale, info, b.validations,
                       b.acceptance_records)


def random_source(preset: str, seed: int = 0) -> ModelSource:
    cfg = gpt_preset(preset)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    target, drafter = GPT(cfg).eval(), Drafter(cfg).eval()
    codebook = torch.nn.functional.normalize(torch.randn(cfg.vocab_size, 8), dim=1)
    torch.random.set_rng_state(gen_state)
    proximity = build_proximity_table(codebook, RANDOM_PROXIMITY_K)
    info = {"kind": "random", "name": f"random:{preset}", "config": cfg.to_dict(), "seed": seed,
            "has_drafter": True, "has_proximity": True,
            "note": "random weights (no trained bundle): step timings are real, acceptance is not: exact acceptance "
                    "gives tau about 1, and the relaxed rules (LANTERN, LANTERN++) accept far more than on a trained "
                    "model because a random target's distributions are almost flat; rerun with a trained bundle"}
    return ModelSource(target, drafter, proximity, RANDOM_CFG_SCALE, info)
