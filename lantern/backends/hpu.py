"""Intel Gaudi (HPU) backend: every static step an HPU graph, captured in warm-up and replayed, bf16 by default.

Probing availability imports nothing and sets nothing: it looks for the bridge's package (`habana_frameworks`)
without importing it, and for Gaudi devices in sysfs. The bridge is imported when a runner is prepared, and only
then: HPU graphs run only in lazy mode, which the bridge reads from PT_HPU_LAZY_MODE when imported, so preparing
sets PT_HPU_LAZY_MODE=1 for the process (any other value is refused), declares a GaudiConfig's autocast op
lists (gaudi_config.py), then imports. After every step `mark_step` flushes what lazy mode accumulated.
`wrap_in_hpu_graph` keys one graph per distinct input shape and per distinct non-tensor argument: every step
argument is a tensor of a StaticSpec shape (positions and slots included), so a whole generation uses exactly
`runner.graph_keys()` graphs.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from lantern.backends.base import (Abilities, Availability, BackendUnavailable, Capabilities, Runner, StaticSpec,
                                   StepOutput, parse_dtype)
from lantern.backends.memory import AllocatorPeak
from lantern.backends.gaudi_config import GaudiSettings, load_gaudi_config
from lantern.backends.torch_eager import CPUBackend
from lantern.backends.torch_graph import CapturedRunner, FusingBackend, fusable

INSTALL_HINT = "install Habana's PyTorch bridge, then pip install 'lantern-decoding[hpu]'"
LAZY_ENV = "PT_HPU_LAZY_MODE"
DEVICE_TYPE = "hpu"
# where the habanalabs driver registers Gaudi devices: the accel subsystem, or its own class on older kernels
SYSFS_DEVICES = ((Path("/sys/class/accel"), re.compile(r"accel\d+")),
                 (Path("/sys/class/habanalabs"), re.compile(r"hl\d+")))


def bridge_installed() -> bool:
    """Whether `habana_frameworks` can be found, without importing it."""
    try:
        return importlib.util.find_spec("habana_frameworks") is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return False


def gaudi_devices() -> list[str]:
    """Names of the Gaudi devices the habanalabs driver registered, from sysfs."""
    return [dev.name for folder, pattern in SYSFS_DEVICES if folder.is_dir() for dev in sorted(folder.glob("*"))
            if pattern.fullmatch(dev.name) and (driver := dev / "device" / "driver").exists()
            and driver.resolve().name == "habanalabs"]


def import_bridge(gaudi_config: Optional[GaudiSettings]) -> tuple[ModuleType, ModuleType]:
    """(habana_frameworks.torch.core, habana_frameworks.torch.hpu), imported in lazy mode with the config's
    autocast lists declared first. Sets PT_HPU_LAZY_MODE=1 for the process: the bridge reads it."""
    os.environ[LAZY_ENV] = "1"  # availability() refused any other value
    if gaudi_config is not None:
        gaudi_config.declare()
    try:
        return (importlib.import_module("habana_frameworks.torch.core"),
                importlib.import_module("habana_frameworks.torch.hpu"))
    except Exception as e:  # a broken bridge: say what failed
        raise BackendUnavailable(f"hpu: habana_frameworks failed to import ({type(e).__name__}: {e})") from e


class WholeStep(torch.nn.Module):
    """An engine's fused step as a module, for `wrap_in_hpu_graph` (which wraps modules)."""

    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self) -> torch.Tensor:
        return self.call()


class HPURunner(CapturedRunner):
    """The torch step modules on an HPU, each wrapped by `wrap_in_hpu_graph`."""

    clone_outputs = True  # a replayed HPU graph returns the same output tensors every time
    capture_kind = "habana_frameworks.torch.hpu.wrap_in_hpu_graph (lazy mode)"

    def __init__(self, target, drafter, spec: StaticSpec, device: torch.device, core: ModuleType,
                 hpu: ModuleType, autocast: bool = False, fused: bool = False):
        self.core, self.hpu, self.autocast = core, hpu, autocast
        self.fused = fused and fusable(spec, target) is None
        self.not_fused = fusable(spec, target) if fused else None
        super().__init__(target, drafter, spec, device)

    def wrap_step(self, name, module):
        graph = self.hpu.wrap_in_hpu_graph(copy.copy(module))  # wraps in place: the eager module stays eager
        if not self.autocast:
            return graph

        def step(*args):
            """The graph under autocast (captured so); features back in the runner's dtype, as the contract says."""
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                out = graph(*args)
            return out if out is None else StepOutput(out[0], out[1].to(parse_dtype(self.spec.dtype)))

        return step

    def step_done(self):
        self.core.mark_step()

    def replayable(self, call):
        """The fused step as one HPU graph per engine: `wrap_in_hpu_graph` over a module whose forward is the
        step (no tensor arguments: it reads and writes the engine's persistent buffers, so the graph's key is
        the same every call), under autocast where the runner's steps are, then mark_step."""
        graph = self.hpu.wrap_in_hpu_graph(WholeStep(call))

        def step():
            with (torch.autocast(device_type=self.device.type, dtype=torch.bfloat16) if self.autocast
                  else contextlib.nullcontext()):
                report = graph()
            self.step_done()
            return report
        return step

    def sync(self):
        self.hpu.synchronize()

    def peak_meter(self) -> AllocatorPeak:
        return AllocatorPeak(self.hpu, "habana_frameworks.torch.hpu")

    def profile(self) -> dict:
        return {**super().profile(), "memory_stats": dict(self.hpu.memory_stats())}


class HPUBackend(FusingBackend, CPUBackend):
    """gaudi_config: a gaudi_config.json (or its folder) whose autocast op lists the steps run under; default
    $LANTERN_GAUDI_CONFIG, else none (see gaudi_config.py)."""

    name = "hpu"
    abilities = Abilities(device_kind="hpu", preparation="capture", fused_step=True, dtypes=("bf16", "fp32"))

    def __init__(self, device_index: int = 0, gaudi_config: Optional[str] = None, fused_step: bool = False):
        """fused_step: the engine's whole decode step as one HPU graph per engine (lantern.engine.fused)."""
        super().__init__()
        self.device_index, self.fused_step = device_index, fused_step
        self.gaudi_config = load_gaudi_config(gaudi_config)

    @classmethod
    def availability(cls) -> Availability:
        """From the environment, the package index and sysfs: imports nothing, sets nothing."""
        mode = os.environ.get(LAZY_ENV, "1")
        if mode != "1":
            return Availability(False, f"{LAZY_ENV}={mode}, but HPU graphs run only in lazy mode; unset it or set "
                                       f"{LAZY_ENV}=1 before starting Python")
        if not bridge_installed():
            return Availability(False, f"habana_frameworks is not installed ({INSTALL_HINT})")
        if not gaudi_devices():
            return Availability(False, "no Gaudi device is visible (no habanalabs device in "
                                       + " or ".join(str(folder) for folder, _ in SYSFS_DEVICES) + ")")
        return Availability(True)

    @classmethod
    def supports_family(cls, family: str) -> Availability:
        if family != "llamagen":
            return Availability(False, "HPU graphs of transformers modules have not been run on a Gaudi yet, so "
                                       "lantern does not claim them")
        return Availability(True)

    def capabilities(self) -> Capabilities:
        return Capabilities(device=f"{DEVICE_TYPE}:{self.device_index}", dtypes=self.abilities.dtypes,
                            supports_graphs=True,
                            timer="habana_frameworks.torch.hpu.synchronize + time.perf_counter",
                            memory_source="habana_frameworks.torch.hpu.max_memory_allocated")

    def device(self) -> torch.device:
        """The Gaudi, once the bridge is imported in lazy mode (import_bridge) and sees it."""
        avail = self.availability()
        if not avail.ok:
            raise BackendUnavailable(f"hpu: {avail.reason}")
        self.bridge = import_bridge(self.gaudi_config)
        if not self.bridge[1].is_available():
            raise BackendUnavailable("hpu: no Gaudi device is visible (habana_frameworks.torch.hpu.is_available() "
                                     "is False)")
        return torch.device(DEVICE_TYPE, self.device_index)

    def make_runner(self, target, drafter, spec: StaticSpec, device: torch.device) -> Runner:
        autocast = self.gaudi_config is not None and self.gaudi_config.use_torch_autocast
        return HPURunner(target, drafter, spec, device, *self.bridge, autocast, fused=self.fused_step)
