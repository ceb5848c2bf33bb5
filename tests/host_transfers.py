"""Counting what crosses from tensors to the host: the structural measure of a device-resident decode loop.

A TorchFunctionMode that records every call that copies tensor data to the host or syncs on it (`.item()`,
`.tolist()`, `bool()`, `int()`, `float()`, `.cpu()`, `.numpy()`, and `.to("cpu")` of a tensor on another
device), and how many elements each moved. On an accelerator each is a device sync; on the CPU the same calls
mark the places that would be (`.to(device)` is placement onto the runner's device, not a transfer back).
A test instrument, not part of lantern (tests/decoding/test_speculative.py, tests/decoding/test_jacobi.py and
tools/bench_host_transfers.py use it). Standalone on purpose (torch only), so a benchmark can load it into an
older revision's environment.
"""
from __future__ import annotations

import contextlib

import torch

HOST_CALLS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}


class HostTransfers(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls, self.elements = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        to_host = (name == "to" and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"
                   and any(str(a) == "cpu" for a in list(args[1:]) + list((kwargs or {}).values())))
        if (name in HOST_CALLS or to_host) and args and isinstance(args[0], torch.Tensor):
            self.calls += 1
            self.elements += args[0].numel()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted_steps(module, phase: str = "accept"):
    """Count host transfers while the block runs, marking each call of `module.<phase>` (one per decode step):
    yields the list of (calls, elements) so far at every mark; `per_step` turns it into per-step figures."""
    counter, marks = HostTransfers(), []
    real = getattr(module, phase)

    def marked(*args, **kwargs):
        marks.append((counter.calls, counter.elements))
        return real(*args, **kwargs)

    setattr(module, phase, marked)
    try:
        with counter:
            yield marks
    finally:
        setattr(module, phase, real)


def per_step(marks: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Host transfers and elements between consecutive marks: what one whole step moved."""
    return [b[0] - a[0] for a, b in zip(marks, marks[1:])], [b[1] - a[1] for a, b in zip(marks, marks[1:])]
