"""Relaxations that are bounds, applied where they were validated.

A bundle's manifest ("relaxation_defaults") records, per relaxed method, the settings tools/quality_frontier.py
chose on its quality gate, the sampling they were validated at (top_k, top_p, temperature, cfg_scale) and the
evidence. A relaxation applies by default (a named relaxed method's settings, and `--method auto`'s candidates)
only at a sampling it was validated at; elsewhere the method runs lossless unless the caller allows relaxation
(`--allow-relaxed`). An entry that records no sampling (a bundle validated before the record existed) is treated
as validated nowhere: its evidence came from a gate that could not fail.

A setting must bound something: the LANTERN form's delta is a per-token TV budget, so at most MAX_DELTA (the
papers use delta <= 0.4); k is how many latent neighbours each code may trade mass with, so at most 1/16 of
the codebook (LANTERN's k = 1000 of LlamaGen's 16384 codes). A preset whose k is larger than that for this
codebook runs at the limit; a bundle entry beyond either limit is not applied; settings the caller names
explicitly run as named, with a warning.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from lantern.decoding.config import DecodeConfig, method_preset
from lantern.decoding.sampling import SamplingConfig
from lantern.plan.candidates import RELAXED_METHODS

SAMPLING_KEYS = ("top_k", "top_p", "temperature", "cfg_scale")
MAX_DELTA = 0.4  # the LANTERN form's per-token TV budget: the papers use delta <= 0.4
K_FRACTION = 16  # k at most vocab // K_FRACTION: LANTERN's 1000 of 16384 codes is 6.1%, 1/16 is 6.25%
LOSSLESS = dict(acceptance="exact", k=0, delta=0.0, lam=1.0)  # a relaxed method's drafting, exact acceptance


def k_limit(vocab: int) -> int:
    """The most latent neighbours a setting may use on a codebook of `vocab` codes."""
    return max(1, vocab // K_FRACTION)


def bound_problems(dcfg: DecodeConfig, vocab: int) -> list[str]:
    """Why a decode config's relaxation bounds nothing on this codebook (empty: it bounds something)."""
    if dcfg.acceptance == "exact" or dcfg.k == 0:
        return []
    out = []
    if dcfg.acceptance == "lantern" and dcfg.delta > MAX_DELTA:
        out.append(f"delta {dcfg.delta} lets each token's distribution move by up to {dcfg.delta} in TV "
                   f"(1.0: entirely); allowed: delta <= {MAX_DELTA}")
    if dcfg.k > k_limit(vocab):
        out.append(f"k {dcfg.k} makes {min(dcfg.k, vocab - 1)} of the other {vocab - 1} codes each code's "
                   f"neighbours, so no latent proximity is left; allowed: k <= {k_limit(vocab)} (1/{K_FRACTION} "
                   f"of the codebook)")
    return out


def describe_bound(dcfg: DecodeConfig, vocab: int) -> str:
    """What a decode config's relaxation allows, in words."""
    if dcfg.acceptance == "exact" or dcfg.k == 0 or (dcfg.acceptance == "lantern" and dcfg.delta == 0) or \
            (dcfg.acceptance == "lantern++" and dcfg.lam == 1):
        return "lossless: every token is distributed exactly as AR's"
    where = f"only among each code's {dcfg.k} nearest of {vocab} codes"
    if dcfg.form == "paper":
        return (f"the papers' per-candidate rule ({dcfg.acceptance}, {where}): its distortion is not bounded; the "
                f"recorded TV is a proxy")
    if dcfg.acceptance == "lantern":
        return f"each token's distribution moves by at most {dcfg.delta} in TV, {where}"
    return (f"no token's probability grows beyond {dcfg.lam:g}x AR's (the TV moved is at most {dcfg.lam - 1:g}x the "
            f"mass of the tokens the drafts over-propose), {where}")


def sampling_record(sampling: SamplingConfig) -> dict:
    """The sampling settings a validation records."""
    return {k: getattr(sampling, k) for k in SAMPLING_KEYS}


def same_sampling(record: dict, sampling: SamplingConfig, vocab: int) -> bool:
    """Whether `sampling` is the one `record` holds: top-k compared by the support it leaves (0 and >= vocab are
    both the whole vocabulary), the rest to float precision; greedy decoding matches no sampling record."""
    if sampling.greedy:
        return False
    other = SamplingConfig(**{k: record[k] for k in SAMPLING_KEYS})
    return other.support_size(vocab) == sampling.support_size(vocab) and all(
        math.isclose(getattr(other, k), getattr(sampling, k), rel_tol=1e-9) for k in ("top_p", "temperature",
                                                                                         "cfg_scale"))


@dataclass(frozen=True)
class Validation:
    """One validated relaxation: its settings, the sampling it was validated at (None: not recorded), the
    evidence (the quality gate's verdict)."""

    settings: dict
    sampling: Optional[dict]
    evidence: dict = field(default_factory=dict, compare=False)


def read_validations(entries: dict) -> dict[str, tuple[Validation, ...]]:
    """A manifest's "relaxation_defaults": per method a list of {"settings", "sampling", "evidence"}, or (older
    bundles) one {"settings", "evidence"} with no sampling. ValueError naming the method when malformed."""
    if not isinstance(entries, dict):
        raise ValueError(f"manifest field 'relaxation_defaults' must be an object, got {type(entries).__name__}")
    out = {}
    for method, value in entries.items():
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, dict) and isinstance(v.get("settings"), dict) for v in items):
            raise ValueError(f"manifest relaxation_defaults[{method!r}] must hold objects with 'settings'")
        bad = [v["sampling"] for v in items if v.get("sampling") is not None
               and not (isinstance(v["sampling"], dict) and set(SAMPLING_KEYS) <= set(v["sampling"]))]
        if bad:
            raise ValueError(f"manifest relaxation_defaults[{method!r}]: sampling {bad[0]!r} must name "
                             f"{', '.join(SAMPLING_KEYS)}")
        out[method] = tuple(Validation(dict(v["settings"]), v.get("sampling"), v.get("evidence", {})) for v in items)
    return out


def sampling_text(record: dict) -> str:
    return ", ".join(f"{k} {record[k]}" for k in SAMPLING_KEYS)


@dataclass(frozen=True)
class Relaxation:
    """What a relaxed method runs with for one request: `settings` (None: lossless) and why, in words."""

    method: str
    settings: Optional[dict]
    why: str
    validated_at: Optional[dict] = None  # the sampling of the validation it applies, if one

    def to_dict(self) -> dict:
        return {"method": self.method, "applied": self.settings is not None, "settings": self.settings,
                "validated_at": self.validated_at, "why": self.why}


def relaxation_for(method: str, validations: dict, sampling: SamplingConfig, vocab: int,
                   allow_relaxed: bool) -> Relaxation:
    """The relaxation `method` runs with at `sampling` on a codebook of `vocab` codes: the bundle's validation at
    this sampling; else, with allow_relaxed, the bundle's settings validated elsewhere or the preset's (k at
    most k_limit); else none (lossless)."""
    entries = validations.get(method, ())
    usable = [v for v in entries if not bound_problems(method_preset(method, sampling, **v.settings), vocab)]
    here = next((v for v in usable if v.sampling is not None and same_sampling(v.sampling, sampling, vocab)), None)
    if here is not None:
        return Relaxation(method, dict(here.settings), f"validated at this sampling ({sampling_text(here.sampling)})",
                          here.sampling)
    recorded = [v for v in usable if v.sampling is not None]
    elsewhere = (f"validated only at {'; '.join(sampling_text(v.sampling) for v in recorded)}" if recorded else
                 "the bundle's validation records no sampling (treated as validated nowhere)"
                 if any(v.sampling is None for v in usable) else
                 "the bundle's validated settings bound nothing (" + "; ".join(
                     bound_problems(method_preset(method, sampling, **entries[0].settings), vocab)) + ")"
                 if entries else "the bundle validates no relaxation for it")
    if not allow_relaxed:
        return Relaxation(method, None, f"lossless: not validated at this sampling ({elsewhere}); --allow-relaxed "
                                        f"runs it relaxed")
    if usable:
        chosen = recorded[0] if recorded else usable[0]
        return Relaxation(method, dict(chosen.settings), f"relaxed (--allow-relaxed) at the bundle's settings; not "
                                                         f"validated here ({elsewhere})")
    preset = method_preset(method, sampling)
    if preset.k <= k_limit(vocab):
        return Relaxation(method, {}, f"relaxed (--allow-relaxed) at the preset's settings; not validated here "
                                      f"({elsewhere})")
    return Relaxation(method, {"k": k_limit(vocab)}, f"relaxed (--allow-relaxed) at the preset's settings, k "
                                                     f"{preset.k} clipped to {k_limit(vocab)} of {vocab} codes; not "
                                                     f"validated here ({elsewhere})")


def allowed_relaxations(validations: dict, sampling: SamplingConfig, vocab: int,
                        allow_relaxed: bool) -> dict[str, Relaxation]:
    """relaxation_for every relaxed method."""
    return {m: relaxation_for(m, validations, sampling, vocab, allow_relaxed) for m in RELAXED_METHODS}


RELAXATION_FIELDS = ("acceptance", "k", "delta", "lam", "form")


def relaxed_method(dcfg: DecodeConfig) -> Optional[str]:
    """The relaxed method whose validations govern `dcfg`, by its drafting (a Jacobi window: mc-sjd-relaxed;
    EAGLE-2's dynamic tree: lantern; a static tree: lantern++, as auto's relaxed trees); None where its acceptance
    is exact or nothing is drafted."""
    if dcfg.acceptance == "exact" or not dcfg.speculative:
        return None
    return "mc-sjd-relaxed" if dcfg.jacobi else "lantern" if dcfg.drafting == "dynamic" else "lantern++"


def guarded(dcfg: DecodeConfig, validations: Optional[dict], vocab: int,
            allow_relaxed: bool) -> tuple[DecodeConfig, Optional[dict]]:
    """The decode config that runs for `dcfg` (Pipeline.generate applies it; the command line and the service ask
    it) and, for a relaxed one, what relaxation applied and why (None for the others). A relaxed config at its
    method's preset settings takes relaxation_for's: the bundle's validated at its sampling, else (allow_relaxed)
    the bundle's or the preset's within k_limit, else exact acceptance (lossless). Settings other than the
    preset's run as given with allow_relaxed (a warning where they bound nothing), else as the preset's do.
    validations None: models without a bundle's record (a bare Pipeline, a model family's folder), which claims
    nothing to hold them to: `dcfg` runs as given."""
    method = relaxed_method(dcfg)
    if method is None or validations is None:
        return dcfg, None
    relaxation = relaxation_for(method, validations, dcfg.sampling, vocab, allow_relaxed)
    preset = {k: getattr(method_preset(method, dcfg.sampling), k) for k in RELAXATION_FIELDS}
    given = {k: getattr(dcfg, k) for k in RELAXATION_FIELDS}
    info = relaxation.to_dict()
    run = replace(dcfg, **{**preset, **(LOSSLESS if relaxation.settings is None else relaxation.settings)})
    if allow_relaxed and given not in (preset, {k: getattr(run, k) for k in RELAXATION_FIELDS}):
        run = dcfg
        named = ", ".join(f"{k} {v}" for k, v in given.items() if v != preset[k])
        info.update(applied=True, settings=given, validated_at=None, why=f"as given ({named}), relaxation allowed")
    problems = bound_problems(run, vocab)
    info["allows"] = describe_bound(run, vocab)
    if problems:
        info["warnings"] = problems
    return run, info
