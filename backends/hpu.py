"""Intel Gaudi (HPU) backend: every static step an HPU graph, captured in warm-up and replayed, bf16 by default.

Habana's bridge (`habana_frameworks`) is imported only inside this backend when it is asked for, never at
module scope, so `lantern backends` works and says why on machines without it. HPU graphs run only in lazy
mode, so the bridge is imported with PT_HPU_LAZY_MODE=1 set explicitly; after every step `mark_step` flushes
what lazy mode accumulated. `wrap_in_hpu_graph` keys one graph per distinct input shape and per distinct
non-tensor argument: every step argument is a tensor of a StaticSpec shape (positions and slots included),
so a whole generation uses exactly `runner.graph_keys()` graphs.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from lantern.backends.base import (Availability, Backend, BackendUnavailable, Capabilities, MemoryReport, Runner,
                                   StaticSpec)
from lantern.backends.torch_eager import SharedWeights
from lantern.backends.torch_graph import CapturedRunner

INSTALL_HINT = "install Habana's PyTorch bridge, then pip install lantern[hpu]"
LAZY_ENV = "PT_HPU_LAZY_MODE"
DEVICE_TYPE = "hpu"


def import_bridge() -> tuple[ModuleType, ModuleType]:
    """(habana_frameworks.torch.core, habana_frameworks.torch.hpu), imported in lazy mode."""
    mode = os.environ.setdefault(LAZY_ENV, "1")
    if mode != "1":
        raise BackendUnavailable(f"hpu: {LAZY_ENV}={mode}, but HPU graphs run only in lazy mode; "
                                 f"unset it or set {LAZY_ENV}=1 before starting Python")
    return (importlib.import_module("habana_frameworks.torch.core"),
            importlib.import_module("habana_frameworks.torch.hpu"))


class HPURunner(CapturedRunner):
    """The torch step modules on an HPU, each wrapped by `wrap_in_hpu_graph`."""

    clone_outputs = True  # a replayed HPU graph returns the same output tensors every time
    capture_kind = "habana_frameworks.torch.hpu.wrap_in_hpu_graph (lazy mode)"

    def __init__(self, target, drafter, spec: StaticSpec, device: torch.device, core: ModuleType,
                 hpu: ModuleType):
        self.core, self.hpu = core, hpu
        super().__init__(target, drafter, spec, device)

    def wrap_step(self, name, module):
        return self.hpu.wrap_in_hpu_graph(module)

    def step_done(self):
        self.core.mark_step()

    def sync(self):
        self.hpu.synchronize()

    def reset_peak_memory(self):
        self.hpu.reset_peak_memory_stats()

    def memory(self) -> MemoryReport:
        peak = self.hpu.max_memory_allocated()
        fixed = self.weights_bytes + self.kv_bytes() + self.tree_buffer_bytes()
        return MemoryReport(peak_bytes=peak, weights_bytes=self.weights_bytes, kv_cache_bytes=self.kv_bytes(),
                            tree_buffer_bytes=self.tree_buffer_bytes(), workspace_bytes=max(peak - fixed, 0),
                            source="habana_frameworks.torch.hpu.max_memory_allocated")

    def profile(self) -> dict:
        return {**super().profile(), "memory_stats": dict(self.hpu.memory_stats())}


class HPUBackend(SharedWeights, Backend):
    name = "hpu"

    def __init__(self, device_index: int = 0):
        self.device_index = device_index

    @classmethod
    def availability(cls) -> Availability:
        try:
            _, hpu = import_bridge()
        except BackendUnavailable as e:
            return Availability(False, str(e).removeprefix("hpu: "))
        except Exception as e:  # a missing or broken bridge must not break listing or `auto`
            if isinstance(e, ImportError) and e.name == "habana_frameworks":
                return Availability(False, f"habana_frameworks is not installed ({INSTALL_HINT})")
            return Availability(False, f"habana_frameworks failed to import ({type(e).__name__}: {e})")
        if not hpu.is_available():
            return Availability(False, "no Gaudi device is visible (habana_frameworks.torch.hpu.is_available() "
                                       "is False)")
        return Availability(True)

    def capabilities(self) -> Capabilities:
        return Capabilities(device=f"{DEVICE_TYPE}:{self.device_index}", dtypes=("bf16", "fp32"),
                            supports_graphs=True,
                            timer="habana_frameworks.torch.hpu.synchronize + time.perf_counter",
                            memory_source="habana_frameworks.torch.hpu.max_memory_allocated")

    def prepare(self, target, drafter, spec: StaticSpec) -> Runner:
        avail = self.availability()
        if not avail.ok:
            raise BackendUnavailable(f"hpu: {avail.reason}")
        self.check_dtype(spec.dtype)
        core, hpu = import_bridge()
        device = torch.device(DEVICE_TYPE, self.device_index)
        runner = HPURunner(*self.placed(target, drafter if spec.draft_widths else None, device, spec.dtype), spec,
                           device, core, hpu)
        runner.backend_name = self.name
        return runner
