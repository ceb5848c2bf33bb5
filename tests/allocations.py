"""The peak of tensor memory a piece of code holds, counted on the `meta` device: every op's outputs are
counted when they appear and dropped when their storage is freed, so code runs at any size with no memory and
no arithmetic (what it would allocate on a real device, kernels' own scratch aside)."""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class PeakAllocations(TorchDispatchMode):
    """with PeakAllocations() as seen: ...; seen.peak is the most bytes held at once by tensors created
    inside the block (inputs made before it are not counted)."""

    def __init__(self):
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}  # may hold freed storages until the next prune
        self.held = 0  # bytes in `live`: at least what is held now
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {StorageWeakRef(t.untyped_storage()) for t in _tensors([*args, *kwargs.values()])}
        for t in _tensors(out):
            ref = StorageWeakRef(t.untyped_storage())
            if ref not in inputs and ref not in self.live:  # a view or an in-place result allocates nothing
                self.live[ref] = t.untyped_storage().nbytes()
                self.held += self.live[ref]
        if self.held > self.peak:  # only then can what is held now exceed the peak: count it exactly
            # (a weak reference keeps a freed storage's address from being reused, so keys never alias)
            expired = torch.UntypedStorage._expired  # StorageWeakRef.expired without its Python frame: this scan
            # is most of the instrument's cost
            self.live = {ref: n for ref, n in self.live.items() if not expired(ref.cdata)}
            self.held = sum(self.live.values())
            self.peak = max(self.peak, self.held)
        return out


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)
