"""Sampling settings per slot: temperature and CFG scale are (B,) tensors set when a request takes its slot;
greedy, top-k, top-p and CFG on or off (the rows per image) stay the engine's, fixed by its static shapes."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from lantern.decoding.sampling import SamplingConfig
from lantern.engine.host_values import to_device

PER_REQUEST = ("temperature", "cfg_scale")


@dataclass(frozen=True)
class SamplingOverrides:
    """Per-request sampling. temperature and cfg_scale may differ from the engine's (cfg_scale only where the
    engine's CFG is on: it fixes the rows per image); top_k and top_p must equal the engine's. None: the
    engine's value."""

    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    cfg_scale: Optional[float] = None


def request_sampling(engine: SamplingConfig, overrides: Optional[SamplingOverrides]) -> SamplingConfig:
    """The request's own settings (checked, naming the bad value and what is allowed)."""
    if overrides is None:
        return engine
    given = {f.name: getattr(overrides, f.name) for f in fields(overrides) if getattr(overrides, f.name) is not None}
    for name, value in given.items():
        if name not in PER_REQUEST and value != getattr(engine, name):
            raise ValueError(f"sampling {name}={value!r} differs from this engine's {getattr(engine, name)!r}; "
                             f"per request only {' and '.join(PER_REQUEST)} may differ (docs/engine.md)")
    mine = replace(engine, **given)  # SamplingConfig checks the values
    if mine.use_cfg and not engine.use_cfg:
        raise ValueError(f"sampling cfg_scale={mine.cfg_scale!r}: this engine runs without CFG (cfg_scale 1); "
                         f"a request cannot turn it on (it adds rows to the static shape)")
    return mine


class SlotSampling:
    """The engine's SamplingConfig with temperature and cfg_scale one per slot: what the step's distributions
    read (lantern.decoding.sampling takes either)."""

    def __init__(self, base: SamplingConfig, width: int, device):
        self.base = base
        self.temperature = torch.full((width,), base.temperature, device=device)
        self.cfg_scale = torch.full((width,), base.cfg_scale, device=device)

    def admit(self, slots: torch.Tensor, settings: list[SamplingConfig]) -> None:
        dev = self.temperature.device
        self.temperature[slots] = to_device([s.temperature for s in settings], dev, self.temperature.dtype)
        self.cfg_scale[slots] = to_device([s.cfg_scale for s in settings], dev, self.cfg_scale.dtype)

    greedy = property(lambda self: self.base.greedy)
    top_k = property(lambda self: self.base.top_k)
    top_p = property(lambda self: self.base.top_p)
    use_cfg = property(lambda self: self.base.use_cfg)
    rows_per_image = property(lambda self: self.base.rows_per_image)

    def support_size(self, vocab: int) -> int:
        return self.base.support_size(vocab)
