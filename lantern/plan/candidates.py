"""The plans `--method auto` chooses among: AR, Jacobi windows, drafter trees (static and EAGLE-2), each a named
method preset plus overrides. Relaxed plans join only when the caller allows relaxation."""
from __future__ import annotations

from dataclasses import dataclass

from lantern.decoding.config import DecodeConfig, method_preset
from lantern.decoding.sampling import SamplingConfig

JACOBI_WINDOWS = (4, 8, 16, 32)
EXACT_TREES = ("chain-5", "eagle1-25", "lantern++-57")
RELAXED_TREES = ("chain-5", "lantern++-57")


@dataclass(frozen=True)
class Plan:
    """One candidate: `name` is its stable id (the key of its acceptance record and step latency)."""

    name: str
    method: str  # a METHODS preset
    overrides: tuple[tuple[str, object], ...] = ()

    @property
    def lossless(self) -> bool:
        return self.decode(SamplingConfig()).acceptance == "exact"

    def decode(self, sampling: SamplingConfig, relaxation: dict | None = None) -> DecodeConfig:
        """The decode config at these sampling settings; relaxation: the bundle's validated k / delta / lambda
        for this plan's method (relaxed plans only)."""
        extra = relaxation or {}
        return method_preset(self.method, sampling, **{**extra, **dict(self.overrides)})

    def describe(self) -> dict:
        return {"name": self.name, "method": self.method, **dict(self.overrides)}


AR = Plan("ar", "ar")


def jacobi(window: int, relaxed: bool = False) -> Plan:
    method = "mc-sjd-relaxed" if relaxed else "mc-sjd"
    return Plan(f"{method}/L{window}", method, (("window", window),))


def tree(preset: str, relaxed: bool = False) -> Plan:
    if relaxed:
        return Plan(f"lantern++/{preset}", "lantern++", (("drafting", preset),))
    return Plan(f"exact/{preset}", "lantern++", (("drafting", preset), ("acceptance", "exact"), ("k", 0),
                                                 ("lam", 1.0)))


RELAXED_METHODS = ("mc-sjd-relaxed", "lantern", "lantern++")


def candidate_plans(has_drafter: bool, has_proximity: bool, relaxed_methods=()) -> list[Plan]:
    """Every plan the model can run: lossless ones always, relaxed ones (which need the proximity table) only
    for the methods in `relaxed_methods`. AR first: on a tie it wins."""
    plans = [AR, *(jacobi(w) for w in JACOBI_WINDOWS)]
    if has_drafter:
        plans += [Plan("eagle2", "eagle2"), *(tree(t) for t in EXACT_TREES)]
    if not has_proximity:
        return plans
    if "mc-sjd-relaxed" in relaxed_methods:
        plans.append(jacobi(16, relaxed=True))
    if has_drafter and "lantern" in relaxed_methods:
        plans.append(Plan("lantern", "lantern"))
    if has_drafter and "lantern++" in relaxed_methods:
        plans += [tree(t, relaxed=True) for t in RELAXED_TREES]
    return plans
