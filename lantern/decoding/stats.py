"""What a generation measured, per image: tau, step compression, per-depth acceptance, the true TV of the
relaxed target each token came from (bounded rule), the papers' boosts, forwards and phase times.

Definitions (docs/algorithms.md): tau = mean over an image's verify steps of accepted drafts + 1 bonus;
step compression = an image's tokens / the target forwards that image took (prefill included; a batch of B
images shares each forward, and each image counts it once).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ImageStats:
    tokens: int
    target_forwards: int  # prefill + the verify (or AR decode) steps this image ran in
    accepted_lengths: list[int] = field(default_factory=list)  # per verify step: accepted drafts + 1 bonus
    depth_tried: Counter = field(default_factory=Counter)  # depth -> steps whose walk tried children there
    depth_accepted: Counter = field(default_factory=Counter)  # depth -> steps that accepted a child there
    accepted_ranks: list[tuple[int, ...]] = field(default_factory=list)  # per step: child ranks of the path
    token_tv: list[float] = field(default_factory=list)  # per token from a verify step: TV(p_hat, p)
    boost: list[float] = field(default_factory=list)  # papers' rule: per accepted draft, its boost

    @property
    def tau(self) -> float:
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 1.0

    @property
    def step_compression(self) -> float:
        return self.tokens / self.target_forwards if self.target_forwards else 0.0

    def summary(self) -> dict:
        return {"tokens": self.tokens, "target_forwards": self.target_forwards, "tau": self.tau,
                "step_compression": self.step_compression, "acceptance_by_depth": _by_depth(self),
                "token_tv_max": max(self.token_tv, default=0.0)}


def _by_depth(s) -> dict:
    return {d: s.depth_accepted[d] / s.depth_tried[d] for d in sorted(s.depth_tried)}


def _over_images(name: str) -> property:
    """An ImageStats list field over every image of a GenerationStats, in order."""
    return property(lambda self: [x for image in self.images for x in getattr(image, name)])


@dataclass
class GenerationStats:
    images: list[ImageStats] = field(default_factory=list)
    draft_forwards: int = 0  # drafter steps (catch-ups and tree levels), each over the whole batch
    batch: int = 0  # the runner's static image width B
    phase_seconds: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0  # decode wall time (VQ decode excluded)

    def merge(self, other: "GenerationStats") -> None:
        """Append another chunk's images."""
        self.images += other.images
        self.draft_forwards += other.draft_forwards
        self.batch = max(self.batch, other.batch)
        for k, v in other.phase_seconds.items():
            self.phase_seconds[k] = self.phase_seconds.get(k, 0.0) + v
        self.wall_seconds += other.wall_seconds

    @property
    def tokens(self) -> int:
        return sum(i.tokens for i in self.images)

    @property
    def target_forwards(self) -> int:
        """Summed over images: each image counts every forward it took part in."""
        return sum(i.target_forwards for i in self.images)

    accepted_lengths = _over_images("accepted_lengths")
    accepted_ranks = _over_images("accepted_ranks")
    token_tv = _over_images("token_tv")
    boost = _over_images("boost")

    @property
    def depth_tried(self) -> Counter:
        return sum((i.depth_tried for i in self.images), Counter())

    @property
    def depth_accepted(self) -> Counter:
        return sum((i.depth_accepted for i in self.images), Counter())

    @property
    def mean_accepted_length(self) -> float:
        """tau over every verify step of every image (1.0 for AR)."""
        lengths = self.accepted_lengths
        return sum(lengths) / len(lengths) if lengths else 1.0

    @property
    def step_compression(self) -> float:
        return self.tokens / self.target_forwards if self.target_forwards else 0.0

    def summary(self) -> dict:
        tv, boost = self.token_tv, self.boost
        return {
            "images": len(self.images),
            "batch": self.batch,
            "tokens": self.tokens,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "verify_steps": len(self.accepted_lengths),
            "mean_accepted_length": self.mean_accepted_length,
            "step_compression": self.step_compression,
            "acceptance_by_depth": _by_depth(self),
            "accepted_length_histogram": dict(sorted(Counter(self.accepted_lengths).items())),
            "token_tv_max": max(tv, default=0.0),
            "token_tv_mean": sum(tv) / len(tv) if tv else 0.0,
            "paper_boost_max": max(boost, default=0.0),
            "paper_boost_mean": sum(boost) / len(boost) if boost else 0.0,
            "per_image": [i.summary() for i in self.images],
            "phase_seconds": dict(self.phase_seconds),
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens / self.wall_seconds if self.wall_seconds else 0.0,
        }
