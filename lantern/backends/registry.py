"""Backend discovery: a dict of built-ins by name, plus the `lantern.backends` entry-point group.

Built-ins are named by "module:Class" strings and imported only when asked for, so listing backends
never imports a heavy SDK (habana_frameworks, onnxruntime) that may be missing or broken.
"""
from __future__ import annotations

import importlib
import os
from importlib.metadata import entry_points

from lantern.backends.base import Backend, BackendUnavailable

ENV_VAR = "LANTERN_BACKEND"

BUILTIN: dict[str, str] = {
    "cpu": "lantern.backends.torch_eager:CPUBackend",
    "cuda": "lantern.backends.torch_eager:CUDABackend",
    "cpu-graph": "lantern.backends.torch_graph:CPUGraphBackend",
    "cuda-graph": "lantern.backends.torch_graph:CUDAGraphBackend",
    "hpu": "lantern.backends.hpu:HPUBackend",
    "onnx": "lantern.backends.onnx_runtime:ONNXBackend",
    "onnx-cuda": "lantern.backends.onnx_runtime:ONNXCUDABackend",
}

# `auto` tries these in order and takes the first available.
AUTO_ORDER = ("hpu", "cuda", "cpu")


def registered() -> dict[str, str]:
    """name -> "module:Class" for built-ins and every installed entry point."""
    names = dict(BUILTIN)
    for ep in entry_points(group="lantern.backends"):
        names.setdefault(ep.name, ep.value)
    return names


def valid_names() -> list[str]:
    return ["auto"] + sorted(registered())


def backend_class(name: str) -> type[Backend]:
    names = registered()
    if name not in names:
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(valid_names())}")
    module, _, attr = names[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def resolve_name(name: str | None = None) -> str:
    """The argument wins over $LANTERN_BACKEND, which wins over 'auto'; 'auto' becomes a concrete name."""
    name = (name or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if name != "auto":
        backend_class(name)  # unknown names fail here, with the list
        return name
    for candidate in AUTO_ORDER:
        if candidate in registered() and backend_class(candidate).availability().ok:
            return candidate
    return "cpu"


def get_backend(name: str | None = None, **options) -> Backend:
    """The backend instance for `name` (or $LANTERN_BACKEND, or auto); raises BackendUnavailable with the
    reason when it is known but cannot run here."""
    resolved = resolve_name(name)
    cls = backend_class(resolved)
    avail = cls.availability()
    if not avail.ok:
        raise BackendUnavailable(f"{resolved}: {avail.reason}")
    return cls(**options)
