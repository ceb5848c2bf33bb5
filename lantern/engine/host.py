"""What the engine needs of the object that hosts it, written down once: the models, the checks, the runners and
rules it prepares once per static shape. lantern.api.Pipeline implements it with public members; the engine
calls these and nothing else of it, so a call never goes back up a layer (tests/shape/test_calls.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from lantern.backends.base import Runner
from lantern.decoding.acceptance import Acceptance
from lantern.decoding.config import DecodeConfig
from lantern.models.family import TargetModel, TargetShape


@dataclass(frozen=True)
class Conditions:
    """Conditions the host checked (Host.conditions), one row per image; whatever takes them does not check them
    again. rows: (n,) int64 class ids (c2i), (n, P) int64 prompt token rows (prompt), or (n, P, C) float32
    caption embeddings (t2i)."""

    rows: torch.Tensor

    def __len__(self) -> int:
        return self.rows.shape[0]


@runtime_checkable
class Host(Protocol):
    """The engine's host: a target and drafter with what is prepared for them on one backend."""

    target: TargetModel
    drafter: Any  # lantern.models.drafter.Drafter (prefix_tokens), or None: methods that draft with none

    @property
    def config(self) -> TargetShape:
        """The target's static facts."""

    def check(self, decode: DecodeConfig, width: int | None) -> int:
        """Refuse a decode config the host cannot run at `width` images per step (None: its default width), before
        any work (ValueError naming the value and what is allowed); returns the width."""

    def check_fits(self, decode: DecodeConfig, width: int, what: str = "this request") -> None:
        """Refuse, before any work, a generation (`what`, named in the refusal) whose predicted peak exceeds the
        memory available."""

    def conditions(self, conditions) -> Conditions:
        """The caller's conditions (class ids, caption embeddings, prompt token rows), checked once."""

    def runner(self, decode: DecodeConfig, width: int) -> Runner:
        """The runner for this static shape, prepared and warmed up once, then reused."""

    def rule(self, decode: DecodeConfig, runner: Runner) -> Acceptance:
        """The decode config's acceptance rule on the runner's device, built once."""

    def add_prepare_seconds(self, spec, seconds: float) -> None:
        """Count `seconds` more as preparing the runner of StaticSpec `spec` (a fused step compiled at an
        engine's first steps, lantern.engine.fused)."""
