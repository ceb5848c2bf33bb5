"""The embedded bundle's models at a benchmark's shape: as trained, or inflated to LlamaGen's compute shapes."""
from __future__ import annotations

from lantern.bundle import load_bundle
from lantern.models.inflate import inflate_models


def models(shape: str):
    """The embedded bundle and its target, drafter and proximity table, or them inflated to `shape`
    ("embedded": as they are)."""
    bundle = load_bundle()
    if shape == "embedded":
        return bundle, (bundle.target, bundle.drafter, bundle.proximity)
    inflated = inflate_models(bundle.target, bundle.drafter, bundle.proximity, shape)
    return bundle, (inflated.target, inflated.drafter, inflated.proximity)
