"""What `--method auto` needs of the pipeline it plans on, written down once: the engine's host (its timed runs go
through the engine) plus the model's identity and defaults, the backend, and the runners prepared so far.
lantern.api.Pipeline implements it with public members; the planner calls these and nothing else of it
(tests/shape/test_calls.py)."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, runtime_checkable

import torch

from lantern.backends.base import Backend
from lantern.decoding.config import DecodeConfig
from lantern.engine.host import Host


@runtime_checkable
class PlanHost(Host, Protocol):
    """A pipeline auto can plan on: the engine's host, and what the plan is keyed by and weighs."""

    proximity: Optional[torch.Tensor]  # the relaxed rules' neighbour table, or None
    backend: Backend
    dtype: str
    defaults: Any  # lantern.api.ModelDefaults: validated sampling, relaxations, acceptance records
    pinned: bool  # its backend was named by the user: auto plans on it alone
    prepare_seconds: Mapping  # StaticSpec -> seconds its runner took to prepare (compile included)
    prepare_started: Mapping  # StaticSpec -> when (time.time()) its runner's preparation started: its identity

    @property
    def model_key(self) -> str:
        """The identity acceptance records and calibrations are keyed by."""

    def spec(self, decode: DecodeConfig, width: int):
        """The StaticSpec of `decode` at `width` images per step."""

    def prepared(self, decode: DecodeConfig, width: int) -> bool:
        """Whether the runner for this static shape is prepared already (its compile paid)."""

    def release(self, keep: Optional[DecodeConfig] = None, batch: int = 0) -> None:
        """Free every prepared runner but the one for (keep, batch), if given."""
