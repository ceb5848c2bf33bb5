"""A generation's true memory peak, and the memory still free, per kind of device: the one place every runner,
profile and JSON takes them from.

A peak meter restarts its window with `reset()` (Pipeline.generate does, before each generation) and `read()`s
the most bytes held at any moment since, whatever freed them before the read:

- HostPeak: the process's resident high-water mark. On Linux the kernel keeps it (VmHWM in /proc/self/status)
  and restarts it from the current resident set when "5" is written to /proc/self/clear_refs. Where that file
  cannot be written (not Linux, or a kernel that refuses), the fallback is ru_maxrss, the peak over the
  process's whole life, and the source says so: never a sampled value called a peak. The mark is the process's,
  so a reset restarts it for every meter of the process (two generations running at once in one process each
  read the peak since the later reset).
- AllocatorPeak: an accelerator allocator's statistics (torch.cuda, habana_frameworks.torch.hpu):
  reset_peak_memory_stats() and max_memory_allocated(), the peak of the tensors it held.

The memory still free is read as a backend's abilities declare it (`memory_query`: the host's, CUDA's, or none).
"""
from __future__ import annotations

import os
import re
import resource
import sys
from pathlib import Path
from typing import Optional

import psutil
import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
RESET_PEAK_RSS = "5"  # clear_refs: restart the resident high-water mark (Linux 4.0+)
HOST_PEAK = "process high-water mark (VmHWM, reset per generation)"
HOST_LIFETIME_PEAK = "process lifetime peak RSS (ru_maxrss: this platform cannot reset the high-water mark)"


def _vm_hwm_bytes() -> Optional[int]:
    """VmHWM of this process in bytes, or None where /proc/self/status has none."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+)\s+kB", STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def _lifetime_peak_rss() -> int:
    """ru_maxrss in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class HostPeak:
    """The process's resident high-water mark since the last reset (see the module docstring)."""

    def __init__(self):
        self.resettable = _vm_hwm_bytes() is not None and os.access(CLEAR_REFS, os.W_OK)

    @property
    def source(self) -> str:
        return HOST_PEAK if self.resettable else HOST_LIFETIME_PEAK

    def reset(self) -> None:
        if not self.resettable:
            return
        try:
            CLEAR_REFS.write_text(RESET_PEAK_RSS)
        except OSError:  # a kernel or sandbox that refuses: report the lifetime peak, labelled so
            self.resettable = False

    def read(self) -> int:
        if self.resettable:
            peak = _vm_hwm_bytes()
            if peak is not None:
                return peak
        return _lifetime_peak_rss()


class AllocatorPeak:
    """An accelerator allocator's peak since the last reset. module: torch.cuda, or anything with its
    reset_peak_memory_stats / max_memory_allocated (habana_frameworks.torch.hpu; tests pass labelled fakes);
    device: passed to both where given."""

    def __init__(self, module, name: str, device=None):
        self.module, self.device = module, device
        self.source = f"{name}.max_memory_allocated"

    def _on_device(self) -> tuple:
        return () if self.device is None else (self.device,)

    def reset(self) -> None:
        self.module.reset_peak_memory_stats(*self._on_device())

    def read(self) -> int:
        return int(self.module.max_memory_allocated(*self._on_device()))


def host_free(device: str) -> tuple[int, str]:
    return psutil.virtual_memory().available, "psutil.virtual_memory().available"


def cuda_free(device: str) -> tuple[int, str]:
    gpu = torch.device(device)
    cached = torch.cuda.memory_reserved(gpu) - torch.cuda.memory_allocated(gpu)  # torch's own free blocks
    return torch.cuda.mem_get_info(gpu)[0] + cached, "torch.cuda.mem_get_info free + memory_reserved - memory_allocated"


FREE_MEMORY = {"host": host_free, "cuda": cuda_free}  # a backend's declared memory query -> how it is read


def available_bytes(backend) -> Optional[tuple[int, str]]:
    """(bytes a new allocation can still take on the backend's device, where that figure comes from), read as its
    abilities declare (`memory_query`), or None where they declare that lantern cannot tell."""
    query = FREE_MEMORY.get(backend.abilities.memory_query)
    return None if query is None else query(backend.capabilities().device)
