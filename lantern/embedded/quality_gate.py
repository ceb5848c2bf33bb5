"""A quality gate that can fail: a candidate sampler's images at one sampling setting against AR's at the same setting.

Three checks, each with a limit derived from AR itself (docs/algorithms.md, 5 "The quality gate"): class accuracy
>= AR's mean - Z' * s_acc; Frechet distance on the evaluator's features <= AR's mean + Z' * s_fd; the mean token TV
the sampler recorded <= its bound (at most MAX_TOKEN_TV). s_fd is AR's seed-to-seed sd at the candidate's image
count, estimated from all of AR's images split at random into runs; s_acc the binomial sd at AR's pooled accuracy;
Z' = Z * sqrt(1 + 1/seeds), Z = 3. Every figure is reported, AR's spread included.
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
PARTITIONS = 200  # random splits of AR's pooled images into runs, for the Frechet distance's sd at n images

GenerateFn = Callable[[torch.Tensor, int], torch.Tensor]  # (class_ids (n,), seed) -> codes (n, h*w)


@dataclass(frozen=True)
class Scored:
    """One run's images as the evaluator sees them."""

    features: np.ndarray  # (n, d) the evaluator's features
    predicted: np.ndarray  # (n,) the evaluator's classes
    labels: np.ndarray  # (n,) the classes requested

    @property
    def n(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Measure:
    """One run's figures."""

    class_accuracy: float
    frechet_distance: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def heldout_features(bundle: Bundle) -> np.ndarray:
    """The evaluator's features of the held-out real images: the Frechet distance's reference set."""
    if bundle.evaluator is None:
        raise ValueError(f"bundle {bundle.path} has no evaluator.safetensors; the quality gate needs one")
    held = load_digits_split("heldout", bundle.vq.config.image_size)
    return bundle.evaluator.predict(held.images)[1].numpy()


def score(bundle: Bundle, codes: torch.Tensor, labels: torch.Tensor) -> Scored:
    """The evaluator's view of generated codes (n, h*w) requested as `labels` (n,)."""
    if len(codes) != len(labels) or len(codes) < 2:
        raise ValueError(f"{len(codes)} images for {len(labels)} labels; need the same number, at least 2")
    images = torch.from_numpy(bundle.decode_images(codes)).permute(0, 3, 1, 2).float() / 127.5 - 1  # (n, 3, H, W)
    pred, feats = bundle.evaluator.predict(images)
    return Scored(feats.numpy(), pred.numpy(), np.asarray(labels))


def measure(run: Scored, heldout: np.ndarray) -> Measure:
    """A run's class accuracy and Frechet distance to the held-out features `heldout`."""
    return Measure(class_accuracy(run.predicted, run.labels), frechet_distance(run.features, heldout), run.n)


def sample(generate_fn: GenerateFn, classes: Sequence[int], n_per_class: int,
           seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n_per_class images of each class in one call of generate_fn (image i draws from its own stream of
    `seed`, so runs at different seeds share no draws): (codes (n, h*w), labels (n,))."""
    labels = torch.tensor(list(classes), dtype=torch.long).repeat_interleave(n_per_class)
    return torch.as_tensor(generate_fn(labels, seed)), labels


def random_runs(labels: np.ndarray, runs: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A random split of pooled images requested as `labels` into `runs` disjoint runs, each with the same number
    of images of each class: the indices of each run."""
    parts = [[] for _ in range(runs)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        if len(idx) % runs:
            raise ValueError(f"{len(idx)} images of class {c} do not split into {runs} equal runs")
        for part, chunk in zip(parts, np.split(idx, runs)):
            part.append(chunk)
    return [np.concatenate(p) for p in parts]


@dataclass(frozen=True)
class Reference:
    """AR's spread at one sampling setting and image count, and the gate's limits derived from it: what
    `Reference.of` measured, kept as figures (results files store them and read them back)."""

    spread: dict

    @classmethod
    def of(cls, runs: Sequence[Scored], heldout: np.ndarray, seed: int = 0) -> "Reference":
        """From AR's runs over seeds (each of the same classes and image count)."""
        if len(runs) < MIN_AR_SEEDS:
            raise ValueError(f"{len(runs)} AR runs; the gate needs at least {MIN_AR_SEEDS} (a spread over seeds)")
        if len({tuple(np.sort(r.labels)) for r in runs}) != 1:
            raise ValueError(f"AR runs of {sorted({r.n for r in runs})} images; they must request the same classes "
                             f"and number")
        s, n = len(runs), runs[0].n
        per_seed = [measure(r, heldout) for r in runs]
        acc = [m.class_accuracy for m in per_seed]
        fd = [m.frechet_distance for m in per_seed]
        feats, labels = np.concatenate([r.features for r in runs]), np.concatenate([r.labels for r in runs])
        pooled_acc = class_accuracy(np.concatenate([r.predicted for r in runs]), labels)
        rng = np.random.default_rng(seed)
        split = np.array([[frechet_distance(feats[idx], heldout) for idx in random_runs(labels, s, rng)]
                          for _ in range(PARTITIONS)])  # (PARTITIONS, S)
        acc_sd = math.sqrt(max(pooled_acc * (1 - pooled_acc), 1 / n) / n)  # 1/n: a floor at accuracy 1.0
        fd_mean, fd_sd = float(split.mean()), float(np.sqrt(split.var(axis=1, ddof=1).mean()))
        margin = Z * math.sqrt(1 + 1 / s)
        return cls({"seeds": s, "images_per_run": n, "z": Z, "margin_sds": margin,
                    "accuracy_per_seed": acc, "accuracy_seed_sd": statistics.stdev(acc),
                    "accuracy_mean": pooled_acc, "accuracy_sd": acc_sd,
                    "frechet_per_seed": fd, "frechet_seed_sd": statistics.stdev(fd),
                    "frechet_mean": fd_mean, "frechet_sd": fd_sd, "partitions": PARTITIONS,
                    "accuracy_limit": pooled_acc - margin * acc_sd, "frechet_limit": fd_mean + margin * fd_sd})

    @property
    def n(self) -> int:
        return self.spread["images_per_run"]

    def to_dict(self) -> dict:
        return dict(self.spread)


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
    s = reference.spread
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
