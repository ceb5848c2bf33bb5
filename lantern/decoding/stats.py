"""What a generation measured: acceptance (tau, per depth, histogram), forwards, moved mass, phase times."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    tokens: int = 0  # image tokens generated (all images)
    target_forwards: int = 0  # prefill + verify/decode steps
    draft_forwards: int = 0  # drafter steps (catch-up and tree levels)
    accepted_lengths: list[int] = field(default_factory=list)  # per verify step: accepted drafts + 1 bonus
    depth_tried: Counter = field(default_factory=Counter)  # depth -> steps whose walk tried children there
    depth_accepted: Counter = field(default_factory=Counter)  # depth -> steps that accepted a child there
    moved_mass: list[float] = field(default_factory=list)  # per accepted draft token
    accepted_ranks: list[tuple[int, ...]] = field(default_factory=list)  # per verify step: child ranks of the path
    phase_seconds: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0  # decode wall time (VQ decode excluded)

    def merge(self, other: "GenerationStats") -> None:
        self.tokens += other.tokens
        self.target_forwards += other.target_forwards
        self.draft_forwards += other.draft_forwards
        self.accepted_lengths += other.accepted_lengths
        self.depth_tried.update(other.depth_tried)
        self.depth_accepted.update(other.depth_accepted)
        self.moved_mass += other.moved_mass
        self.accepted_ranks += other.accepted_ranks
        for k, v in other.phase_seconds.items():
            self.phase_seconds[k] = self.phase_seconds.get(k, 0.0) + v
        self.wall_seconds += other.wall_seconds

    @property
    def mean_accepted_length(self) -> float:
        """tau: mean over verify steps of accepted draft tokens + 1 bonus (1.0 for AR)."""
        if not self.accepted_lengths:
            return 1.0
        return sum(self.accepted_lengths) / len(self.accepted_lengths)

    def summary(self) -> dict:
        depths = sorted(self.depth_tried)
        return {
            "tokens": self.tokens,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "verify_steps": len(self.accepted_lengths),
            "mean_accepted_length": self.mean_accepted_length,
            "step_compression": self.tokens / self.target_forwards if self.target_forwards else 0.0,
            "acceptance_by_depth": {d: self.depth_accepted[d] / self.depth_tried[d] for d in depths},
            "accepted_length_histogram": dict(sorted(Counter(self.accepted_lengths).items())),
            "moved_mass_max": max(self.moved_mass, default=0.0),
            "moved_mass_mean": sum(self.moved_mass) / len(self.moved_mass) if self.moved_mass else 0.0,
            "phase_seconds": dict(self.phase_seconds),
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens / self.wall_seconds if self.wall_seconds else 0.0,
        }
