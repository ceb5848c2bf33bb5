"""The settings of a lantern service, every default in one place (no web or metrics imports here: the command
line reads it to build its flags)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from lantern.api import DEFAULT_BATCH
from lantern.plan.choose import SERVICE_HORIZON


@dataclass(frozen=True)
class ServeConfig:
    """Everything `lantern serve` and the Ray deployment take; every default here."""

    model: Optional[str] = None  # bundle folder, or a Janus / Chameleon (Anole) transformers folder (None: the
    # embedded model)
    backend: Optional[str] = None  # None: $LANTERN_BACKEND, else auto
    dtype: Optional[str] = None  # None: the backend's preferred one
    method: str = "auto"  # what a request without `method` (or with "auto") runs; auto plans once, at warm-up
    methods: Optional[tuple[str, ...]] = None  # what requests may name besides auto (None: all the bundle can run)
    allow_relaxed: bool = False  # auto may choose relaxed plans
    batch: int = DEFAULT_BATCH  # the widest engine's slots: images decoded together, one static step
    widths: Optional[tuple[int, ...]] = None  # the static widths prepared per engine (None: default_widths(batch))
    width_hold_s: float = 1.0  # how long a ladder's highest load still places new images after it fell (clients
    # coming back for their next image within it land on the width they left, not one by one on narrower ones)
    threads: Optional[int] = None  # intra-op threads of the steps (torch, ONNX Runtime); None: the physical cores
    t5: Optional[str] = None  # t2i bundles: the local T5 encoder folder (None: $LANTERN_T5)
    vq: Optional[str] = None  # Chameleon folders: the VQGAN folder (None: found beside the model, as generate finds it)
    max_prompt_tokens: int = 128  # family folders: the longest prompt row (the model's own tokens around the prompt
    # included); every row is left-padded to it, one static shape for prompts of any length
    plan_images: int = SERVICE_HORIZON  # auto: the images its one-time costs are weighed against (lantern.plan)
    queue: int = 64  # images that may wait for a slot; beyond, 429
    timeout_s: float = 300.0  # a request's deadline unless it asks for less (its `timeout`)
    max_timeout_s: float = 3600.0  # the most a request's `timeout` may ask for
    max_n: int = 16  # images per request
    max_engines: int = 4  # engines kept at once, one per (method, sampling overrides) requested
    served_name: Optional[str] = None  # the `model` a request may name (None: the bundle folder's name)
    backend_options: dict = field(default_factory=dict)

    def check(self) -> None:
        """Refuse a bad setting before any loading (ValueError naming it and what is allowed)."""
        for name, low in (("batch", 1), ("queue", 0), ("max_n", 1), ("max_engines", 1), ("plan_images", 1),
                          ("max_prompt_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} {value!r} is not allowed; allowed: an integer >= {low}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"threads {self.threads!r} is not allowed; allowed: an integer >= 1")
        if isinstance(self.width_hold_s, bool) or not isinstance(self.width_hold_s, (int, float)) or not (
                math.isfinite(self.width_hold_s) and self.width_hold_s >= 0):
            raise ValueError(f"width_hold_s {self.width_hold_s!r} is not allowed; allowed: a finite number of seconds "
                             f">= 0")
        for width in self.widths or ():
            if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= self.batch:
                raise ValueError(f"widths: {width!r} is not allowed; allowed: integers in 1..{self.batch} (batch, "
                                 f"the widest)")
        for name in ("timeout_s", "max_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} {value!r} is not allowed; allowed: a finite number of seconds > 0")
        if self.max_n > self.batch + self.queue:
            raise ValueError(f"max_n {self.max_n} exceeds the slots and queue places ({self.batch} + {self.queue}): "
                             f"such a request could never be admitted; allowed: max_n <= batch + queue")
        if self.timeout_s > self.max_timeout_s:
            raise ValueError(f"timeout_s {self.timeout_s} exceeds max_timeout_s {self.max_timeout_s}")

    @property
    def ladder(self) -> tuple[int, ...]:
        """The static widths prepared per engine, narrowest first; the widest is always `batch`."""
        return tuple(sorted({*(self.widths or default_widths(self.batch)), self.batch}))


def default_widths(batch: int) -> tuple[int, ...]:
    """1, 4, 16, ... below `batch`, and `batch`: a request alone runs a width-1 step, a full load the widest."""
    widths, w = [], 1
    while w < batch:
        widths.append(w)
        w *= 4
    return (*widths, batch)
