"""A quality gate that can fail: a candidate sampler's images at one sampling setting against AR's at the same setting.

Three checks, each with a threshold derived from AR itself (docs/algorithms.md, 5 "The quality gate"): class
accuracy >= AR's mean - Z * s_acc; Frechet distance on the evaluator's features <= AR's mean + Z * s_fd; the mean
token TV the sampler recorded <= its bound (at most MAX_TOKEN_TV). s_acc and s_fd are AR's seed-to-seed standard
deviations, each floored by one run's own sampling noise (binomial; bootstrap); Z = 3. Every figure is reported,
AR's spread included, so a reader sees how tight the reference was.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from lantern.bundle import Bundle
from lantern.embedded.data import load_digits_split
from lantern.embedded.metrics import class_accuracy, frechet_distance

Z = 3.0  # tolerance in AR's standard deviations
MAX_TOKEN_TV = 0.4  # the largest per-token TV a relaxation may move (the papers' largest delta)
MIN_AR_SEEDS = 3  # AR runs a reference needs (a standard deviation over seeds)
BOOTSTRAP = 64  # resamples of one run's images for the Frechet distance's sampling sd

GenerateFn = Callable[[torch.Tensor, int], torch.Tensor]  # (class_ids (n,), seed) -> codes (n, h*w)


@dataclass(frozen=True)
class Measure:
    """One run's images scored by the evaluator."""

    class_accuracy: float
    frechet_distance: float
    n: int
    frechet_sd: float  # bootstrap sd of the Frechet distance over this run's images

    def to_dict(self) -> dict:
        return asdict(self)


def heldout_features(bundle: Bundle) -> np.ndarray:
    """The evaluator's features of the held-out real images: the Frechet distance's reference set."""
    if bundle.evaluator is None:
        raise ValueError(f"bundle {bundle.path} has no evaluator.safetensors; the quality gate needs one")
    held = load_digits_split("heldout", bundle.vq.config.image_size)
    return bundle.evaluator.predict(held.images)[1].numpy()


def measure(bundle: Bundle, codes: torch.Tensor, labels: torch.Tensor, reference: np.ndarray,
            seed: int = 0) -> Measure:
    """Score generated codes (n, h*w) requested as `labels` (n,) against the held-out features `reference`."""
    if len(codes) != len(labels) or len(codes) < 2:
        raise ValueError(f"{len(codes)} images for {len(labels)} labels; need the same number, at least 2")
    images = torch.from_numpy(bundle.decode_images(codes)).permute(0, 3, 1, 2).float() / 127.5 - 1  # (n, 3, H, W)
    pred, feats = bundle.evaluator.predict(images)
    feats = feats.numpy()
    rng = np.random.default_rng(seed)
    boot = [frechet_distance(feats[rng.integers(0, len(feats), len(feats))], reference) for _ in range(BOOTSTRAP)]
    return Measure(class_accuracy(pred.numpy(), labels.numpy()), frechet_distance(feats, reference), len(codes),
                   float(np.std(boot, ddof=1)))


def sample(generate_fn: GenerateFn, classes: Sequence[int], n_per_class: int, seed: int,
           chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n_per_class images of each class via generate_fn, `chunk` at a time (chunk i seeded seed + i):
    (codes (n, h*w), labels (n,))."""
    labels = torch.tensor(list(classes), dtype=torch.long).repeat_interleave(n_per_class)
    codes = [torch.as_tensor(generate_fn(part, seed + i)) for i, part in enumerate(labels.split(chunk))]
    return torch.cat(codes), labels


@dataclass(frozen=True)
class Reference:
    """AR at one sampling setting over several seeds, and the gate's limits derived from its spread."""

    runs: tuple[Measure, ...]

    def __post_init__(self):
        if len(self.runs) < MIN_AR_SEEDS:
            raise ValueError(f"{len(self.runs)} AR runs; the gate needs at least {MIN_AR_SEEDS} (a spread over seeds)")
        if len({r.n for r in self.runs}) != 1:
            raise ValueError(f"AR runs of {sorted({r.n for r in self.runs})} images; they must hold the same number")

    @property
    def n(self) -> int:
        return self.runs[0].n

    def spread(self) -> dict:
        """AR's seed-to-seed spread and the sd each limit uses (the larger of it and one run's sampling sd)."""
        acc = [r.class_accuracy for r in self.runs]
        fd = [r.frechet_distance for r in self.runs]
        acc_mean, fd_mean = statistics.fmean(acc), statistics.fmean(fd)
        binomial_sd = math.sqrt(max(acc_mean * (1 - acc_mean), 1 / self.n) / self.n)  # 1/n: a floor at acc 1.0
        bootstrap_sd = statistics.fmean(r.frechet_sd for r in self.runs)
        acc_sd, fd_sd = statistics.stdev(acc), statistics.stdev(fd)
        return {"seeds": len(self.runs), "images_per_run": self.n,
                "accuracy_mean": acc_mean, "accuracy_sd": acc_sd, "accuracy_min": min(acc), "accuracy_max": max(acc),
                "accuracy_binomial_sd": binomial_sd,
                "frechet_mean": fd_mean, "frechet_sd": fd_sd, "frechet_min": min(fd), "frechet_max": max(fd),
                "frechet_bootstrap_sd": bootstrap_sd,
                "accuracy_limit": acc_mean - Z * max(acc_sd, binomial_sd),
                "frechet_limit": fd_mean + Z * max(fd_sd, bootstrap_sd)}

    def to_dict(self) -> dict:
        return {"runs": [r.to_dict() for r in self.runs], "spread": self.spread(), "z": Z}


def token_tv_bound(acceptance: str, delta: float, form: str) -> float:
    """The per-token TV a setting may record: delta for the bounded LANTERN form, else MAX_TOKEN_TV (the bounded
    LANTERN++ form's bound depends on each node's receivers; exact acceptance records 0), never above it."""
    return min(delta, MAX_TOKEN_TV) if acceptance == "lantern" and form == "bounded" else MAX_TOKEN_TV


def gate(reference: Reference, candidate: Measure, token_tv_mean: Optional[float] = None,
         tv_bound: float = MAX_TOKEN_TV) -> dict:
    """Pass or fail, check by check: class accuracy and Frechet distance against AR's limits at the same image
    count, and the mean recorded token TV against `tv_bound` (None: the sampler records none, e.g. AR)."""
    if candidate.n != reference.n:
        raise ValueError(f"a candidate of {candidate.n} images against AR runs of {reference.n}; the limits hold "
                         f"for the image count they were measured at")
    s = reference.spread()
    checks = {
        "class_accuracy": {"value": candidate.class_accuracy, "limit": s["accuracy_limit"], "kind": ">=",
                           "passed": candidate.class_accuracy >= s["accuracy_limit"]},
        "frechet_distance": {"value": candidate.frechet_distance, "limit": s["frechet_limit"], "kind": "<=",
                             "passed": candidate.frechet_distance <= s["frechet_limit"]},
    }
    if token_tv_mean is not None:
        checks["token_tv_mean"] = {"value": token_tv_mean, "limit": tv_bound, "kind": "<=",
                                   "passed": token_tv_mean <= tv_bound + 1e-6}  # float32 sums of a bound-tight TV
    return {"passed": all(c["passed"] for c in checks.values()), "checks": checks, "ar_spread": s,
            "candidate": candidate.to_dict()}


def failed_checks(verdict: dict) -> list[str]:
    """The failed checks in words ("class_accuracy 0.12 < 0.91")."""
    flip = {">=": "<", "<=": ">"}
    return [f"{name} {c['value']:.4g} {flip[c['kind']]} {c['limit']:.4g}" for name, c in verdict["checks"].items()
            if not c["passed"]]
