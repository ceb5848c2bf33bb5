"""Decoding options in one dataclass, and the method presets with the papers' defaults."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from lantern.decoding.acceptance import check_rule
from lantern.decoding.sampling import SamplingConfig
from lantern.decoding.strategy import DynamicTree, JacobiWindow, StaticTree, Strategy
from lantern.decoding.trees import compile_tree, load_tree


@dataclass(frozen=True)
class DecodeConfig:
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    drafting: str = "none"  # "none" (AR) | "dynamic" (EAGLE-2) | "jacobi" (no drafter) | a tree preset | a .json file
    acceptance: str = "exact"  # exact | lantern | lantern++
    k: int = 0  # proximity neighbours the relaxation may use
    delta: float = 0.0  # LANTERN's additive bound, in [0, 1]
    lam: float = 1.0  # LANTERN++'s multiplicative bound, >= 1
    form: str = "bounded"  # relaxation: "bounded" (lantern's, output within the recorded TV) | "paper"
    dynamic_depth: int = 5  # EAGLE-2: drafting depth
    dynamic_top_k: int = 10  # EAGLE-2: beams expanded per depth, children per beam
    dynamic_total: int = 60  # EAGLE-2: verified nodes, root included (the static verify width)
    window: int = 16  # Jacobi: drafts after the root (the verify width is window + 1)
    coupling: str = "gumbel"  # Jacobi: "none" (SJD: fresh draws) | "gumbel" (MC-SJD: noise fixed per position)
    initial: str = "above"  # Jacobi drafts at positions never predicted: "above" (the decided token one grid row
    # up, where there is one; else as "last") | "last" (drawn from the last distribution the step computed)
    branching: int = 1  # Jacobi: candidates verified per position in the first depths (1: the plain window)
    branch_depth: int = 1  # Jacobi, branching > 1: the depths of the window whose every node branches
    tail: int = 0  # Jacobi, branching > 1: stale-tail nodes after each leaf of the branching tree
    fan: int = 0  # Jacobi: more candidates at the first depth, after the branching ones, each a leaf
    _strategy: Strategy | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_rule(self.acceptance, self.k, self.delta, self.lam, self.form)
        if self.drafting == "dynamic":
            for name in ("dynamic_depth", "dynamic_top_k", "dynamic_total"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} {value!r} must be an integer >= 1")
            if self.dynamic_total < 2:
                raise ValueError(f"dynamic_total {self.dynamic_total} must be >= 2 (the root and one node)")
            strategy = DynamicTree(self.dynamic_depth, self.dynamic_top_k, self.dynamic_total)
        elif self.drafting == "jacobi":
            if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
                raise ValueError(f"window {self.window!r} must be an integer >= 1")
            if self.coupling not in COUPLINGS:
                raise ValueError(f"unknown coupling {self.coupling!r}; allowed: {', '.join(COUPLINGS)}")
            if self.initial not in INITIAL_DRAFTS:
                raise ValueError(f"unknown initial drafts {self.initial!r}; allowed: {', '.join(INITIAL_DRAFTS)}")
            for name, least in (("branching", 1), ("branch_depth", 1), ("tail", 0), ("fan", 0)):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(f"{name} {value!r} must be an integer >= {least}")
            strategy = JacobiWindow(self.window, self.branching, self.branch_depth, self.tail, self.fan)
        elif self.drafting != "none":
            # compiled once (fails early, naming the presets)
            strategy = StaticTree(compile_tree(load_tree(self.drafting)))
        else:
            strategy = None
        object.__setattr__(self, "_strategy", strategy)  # frozen, hence object.__setattr__

    @property
    def speculative(self) -> bool:
        return self._strategy is not None

    @property
    def needs_drafter(self) -> bool:
        return self._strategy is not None and bool(self._strategy.draft_widths)

    @property
    def verify_width(self) -> int:
        """Tokens per image one target forward of the decode loop takes (1 for AR)."""
        return 1 if self._strategy is None else self._strategy.verify_width

    @property
    def jacobi(self) -> bool:
        return isinstance(self._strategy, JacobiWindow)

    @property
    def strategy(self) -> Strategy | None:
        """How drafts are made (None: plain AR): owns the widths, depth and scratch layout."""
        return self._strategy

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) if f.name != "sampling" else asdict(self.sampling)
                for f in fields(self) if f.init}


COUPLINGS = ("none", "gumbel")
INITIAL_DRAFTS = ("above", "last")
METHODS = ("ar", "eagle2", "lantern", "lantern++", "sjd", "mc-sjd", "mc-sjd-pac", "mc-sjd-relaxed")


def method_preset(method: str, sampling: SamplingConfig, **overrides) -> DecodeConfig:
    """The common combinations with the papers' defaults; `overrides` (e.g. k, delta, lam, drafting) win."""
    presets = {
        "ar": dict(drafting="none"),
        "eagle2": dict(drafting="dynamic", acceptance="exact"),
        "lantern": dict(drafting="dynamic", acceptance="lantern", k=1000, delta=0.1),
        "lantern++": dict(drafting="lantern++-57", acceptance="lantern++", k=10, lam=3.0),
        "sjd": dict(drafting="jacobi", coupling="none"),
        "mc-sjd": dict(drafting="jacobi", coupling="gumbel"),
        "mc-sjd-pac": dict(drafting="jacobi", coupling="gumbel", window=32, branching=4, branch_depth=2),
        "mc-sjd-relaxed": dict(drafting="jacobi", coupling="gumbel", acceptance="lantern++", k=10, lam=3.0),
    }
    if method == "auto":
        raise ValueError("'auto' is chosen per device, dtype and number of images: Pipeline.plan(n_images) or "
                         "Pipeline.generate(conditions, 'auto')")
    if method not in presets:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    return replace(DecodeConfig(sampling=sampling, **presets[method]), **overrides)


def supported_methods(has_drafter: bool, has_proximity: bool) -> list[str]:
    """The methods a bundle can run: drafting ones need a drafter, relaxed ones a proximity table."""
    out = []
    for method in METHODS:
        dcfg = method_preset(method, SamplingConfig())
        if (has_drafter or not dcfg.needs_drafter) and (has_proximity or dcfg.acceptance == "exact"):
            out.append(method)
    return out
