"""The plans `--method auto` chooses among: AR, Jacobi windows (mc-sjd-pac's too), drafter trees (static and
EAGLE-2), each a named method preset plus overrides. Relaxed plans join only when the caller allows relaxation."""
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

    def decode(self, sampling: SamplingConfig) -> DecodeConfig:
        return method_preset(self.method, sampling, **dict(self.overrides))

    def describe(self) -> dict:
        return {"name": self.name, "method": self.method, **dict(self.overrides)}


AR = Plan("ar", "ar")


def relaxed(name: str, method: str, overrides: tuple, settings: dict) -> Plan:
    """A relaxed plan at `settings` (k / delta / lambda / form; {} = the method's preset): settings other than
    the preset's are part of its name, so records and calibrations never mix two relaxations."""
    suffix = ",".join(f"{k}={v}" for k, v in sorted(settings.items()))
    return Plan(name + (f"@{suffix}" if suffix else ""), method, (*sorted(settings.items()), *overrides))


def jacobi(window: int) -> Plan:
    return Plan(f"mc-sjd/L{window}", "mc-sjd", (("window", window),))


def tree(preset: str) -> Plan:
    """A static tree with exact acceptance (lossless)."""
    return Plan(f"exact/{preset}", "lantern++", (("drafting", preset), ("acceptance", "exact"), ("k", 0),
                                                 ("lam", 1.0)))


RELAXED_METHODS = ("mc-sjd-relaxed", "lantern", "lantern++")


def candidate_plans(has_drafter: bool, has_proximity: bool, relaxation: dict | None = None) -> list[Plan]:
    """Every plan the model can run: lossless ones always; relaxed ones (which need the proximity table) for the
    methods in `relaxation` (method -> its settings, {} for the preset's). AR first: on a tie it wins."""
    relaxation = relaxation or {}
    plans = [AR, *(jacobi(w) for w in JACOBI_WINDOWS), Plan("mc-sjd-pac", "mc-sjd-pac")]
    if has_drafter:
        plans += [Plan("eagle2", "eagle2"), *(tree(t) for t in EXACT_TREES)]
    if not has_proximity:
        return plans
    if "mc-sjd-relaxed" in relaxation:
        plans.append(relaxed("mc-sjd-relaxed/L16", "mc-sjd-relaxed", (("window", 16),), relaxation["mc-sjd-relaxed"]))
    if has_drafter and "lantern" in relaxation:
        plans.append(relaxed("lantern", "lantern", (), relaxation["lantern"]))
    if has_drafter and "lantern++" in relaxation:
        plans += [relaxed(f"lantern++/{t}", "lantern++", (("drafting", t),), relaxation["lantern++"])
                  for t in RELAXED_TREES]
    return plans
