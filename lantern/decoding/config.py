"""Decoding options in one dataclass, and the method presets with the papers' defaults."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from lantern.decoding.acceptance import check_rule
from lantern.decoding.sampling import SamplingConfig
from lantern.decoding.trees import CompiledTree, compile_tree, load_tree


@dataclass(frozen=True)
class DecodeConfig:
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    drafting: str = "none"  # "none" (AR) | "dynamic" (EAGLE-2) | a tree preset name | a .json file of paths
    acceptance: str = "exact"  # exact | lantern | lantern++
    k: int = 0  # proximity neighbours the relaxation may use
    delta: float = 0.0  # LANTERN's additive bound, in [0, 1]
    lam: float = 1.0  # LANTERN++'s multiplicative bound, >= 1
    dynamic_depth: int = 5  # EAGLE-2: drafting depth
    dynamic_top_k: int = 10  # EAGLE-2: beams expanded per depth, children per beam
    dynamic_total: int = 60  # EAGLE-2: verified nodes, root included (the static verify width)
    _tree: CompiledTree | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_rule(self.acceptance, self.k, self.delta, self.lam)
        if self.drafting == "dynamic":
            for name in ("dynamic_depth", "dynamic_top_k", "dynamic_total"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if self.dynamic_total < 2:
                raise ValueError(f"dynamic_total {self.dynamic_total} must be >= 2 (the root and one node)")
        elif self.drafting != "none":
            # compiled once (fails early, naming the presets); frozen, hence object.__setattr__
            object.__setattr__(self, "_tree", compile_tree(load_tree(self.drafting)))

    @property
    def speculative(self) -> bool:
        return self.drafting != "none"

    def static_tree(self) -> CompiledTree | None:
        return self._tree

    @property
    def verify_width(self) -> int:
        """N: root + drafted nodes per verification."""
        if self.drafting == "dynamic":
            return self.dynamic_total
        tree = self.static_tree()
        return tree.size if tree else 1

    @property
    def tree_depth(self) -> int:
        if self.drafting == "dynamic":
            return self.dynamic_depth
        tree = self.static_tree()
        return tree.depth if tree else 0

    @property
    def draft_width(self) -> int:
        if self.drafting == "dynamic":
            return self.dynamic_top_k
        tree = self.static_tree()
        return max(tree.draft_width, 1) if tree else 0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) if f.name != "sampling" else asdict(self.sampling)
                for f in fields(self) if f.init}


METHODS = ("ar", "eagle2", "lantern", "lantern++")


def method_preset(method: str, sampling: SamplingConfig, **overrides) -> DecodeConfig:
    """The common combinations with the papers' defaults; `overrides` (e.g. k, delta, lam, drafting) win."""
    presets = {
        "ar": dict(drafting="none"),
        "eagle2": dict(drafting="dynamic", acceptance="exact"),
        "lantern": dict(drafting="dynamic", acceptance="lantern", k=1000, delta=0.1),
        "lantern++": dict(drafting="lantern++-57", acceptance="lantern++", k=10, lam=3.0),
    }
    if method not in presets:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    return replace(DecodeConfig(sampling=sampling, **presets[method]), **overrides)
