"""A FAKE of Habana's `habana_frameworks` PyTorch bridge, for contract tests without a Gaudi device.

It runs everything on the CPU and records what the real bridge would do:
- `wrap_in_hpu_graph(module)` replaces `module.forward`, as the real one does, and keys graphs the way it
  does: one per distinct hash of the call's arguments, tensors by (shape, dtype, device), anything else by
  value. The first call of a key is a "capture", later ones "replay". Like a real HPU graph, a replay copies
  its inputs into the capture call's input tensors and returns the capture's output tensors, overwritten in
  place (so callers must clone outputs to keep them, and must not reuse tensors they passed to a capture).
- `core.mark_step()` and `hpu.synchronize()` are recorded in one event list, in call order.
`install(monkeypatch)` makes the fake modules importable (found, as a real install is, but only imported when
something imports them) and returns the `FakeHabana` record; `uninstall()` forgets every import of them.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field

import psutil
import torch


def graph_key(obj):
    """The real bridge's input hash, spelled out: tensors by shape/dtype/device, other values as they are."""
    if isinstance(obj, dict):
        return tuple((k, graph_key(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(graph_key(v) for v in obj)
    if torch.is_tensor(obj):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device.type)
    hash(obj)  # unhashable arguments fail in the real bridge too
    return ("value", obj)


def _copy_into(dst, src):
    if torch.is_tensor(dst):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


@dataclass
class FakeHabana:
    available: bool = True
    wrapped: list = field(default_factory=list)  # labels of wrapped modules, in wrapping order
    keys: dict = field(default_factory=dict)  # label -> list of distinct graph keys, in capture order
    events: list = field(default_factory=list)  # ("capture" | "replay", label), ("mark_step",), ("synchronize",)
    peak_bytes: int = 0
    imported_with: dict = field(default_factory=dict)  # the PT_HPU_* environment core was imported under

    def record_import(self) -> None:
        self.imported_with = {k: v for k, v in os.environ.items() if k.startswith("PT_HPU_")}

    def wrap_in_hpu_graph(self, module, asynchronous=False, disable_tensor_cache=False, dry_run=False,
                          max_graphs=None):
        label = f"{type(module).__name__}#{len(self.wrapped)}"
        self.wrapped.append(label)
        self.keys[label] = []
        captured = {}
        forward = module.forward

        def graph_forward(*args, **kwargs):
            key = graph_key((args, kwargs))
            if key not in captured:
                out = forward(*args, **kwargs)
                captured[key] = (args, out)  # the capture call's own tensors become the graph's buffers
                self.keys[label].append(key)
                self.events.append(("capture", label))
                return out
            inputs, outputs = captured[key]
            _copy_into(inputs, args)  # a replay copies new inputs into the capture's input tensors ...
            _copy_into(outputs, forward(*inputs, **kwargs))  # ... and overwrites its output tensors
            self.events.append(("replay", label))
            return outputs

        module.forward = graph_forward
        return module

    def mark_step(self, device_str="", sync=False):
        self.events.append(("mark_step",))

    def synchronize(self):
        self.events.append(("synchronize",))

    def is_available(self):
        return self.available

    def max_memory_allocated(self, device=None):
        self.peak_bytes = max(self.peak_bytes, psutil.Process().memory_info().rss)
        return self.peak_bytes

    def reset_peak_memory_stats(self, device=None):
        self.peak_bytes = 0

    def memory_stats(self, device=None):
        return {"MaxInUse": self.max_memory_allocated(), "fake": True}

    def step_events(self):
        """The events without synchronize calls (those come from timing, not from steps)."""
        return [e for e in self.events if e[0] != "synchronize"]


class _FakeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the fake modules as an installed package would be found; importing one hands out the fake."""

    def __init__(self, modules: dict[str, types.ModuleType], fake: FakeHabana):
        self.modules, self.fake = modules, fake

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self, is_package=True) if name in self.modules else None

    def create_module(self, spec):
        if spec.name == "habana_frameworks.torch.core":
            self.fake.record_import()  # the real bridge reads its environment here
        return self.modules[spec.name]

    def exec_module(self, module):
        pass


def install(monkeypatch) -> FakeHabana:
    """Make fake `habana_frameworks`, `.torch`, `.torch.core`, `.torch.hpu` importable."""
    fake = FakeHabana()
    root = types.ModuleType("habana_frameworks")
    pkg = types.ModuleType("habana_frameworks.torch")
    core = types.ModuleType("habana_frameworks.torch.core")
    hpu = types.ModuleType("habana_frameworks.torch.hpu")
    core.mark_step = fake.mark_step
    for name in ("wrap_in_hpu_graph", "synchronize", "is_available", "max_memory_allocated",
                 "reset_peak_memory_stats", "memory_stats"):
        setattr(hpu, name, getattr(fake, name))
    root.torch, pkg.core, pkg.hpu = pkg, core, hpu
    uninstall()
    monkeypatch.setattr(sys, "meta_path", [_FakeFinder({m.__name__: m for m in (root, pkg, core, hpu)}, fake),
                                           *sys.meta_path])
    return fake


def uninstall() -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "habana_frameworks"]:
        del sys.modules[name]


class _HideHabana(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "habana_frameworks":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def hide(monkeypatch) -> None:
    """Make `import habana_frameworks` fail as on a machine without the bridge, even where it is installed."""
    for name in [n for n in sys.modules if n.split(".")[0] == "habana_frameworks"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_HideHabana(), *sys.meta_path])
