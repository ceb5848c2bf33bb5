"""Optional dependencies: which extra of the `lantern-decoding` distribution provides each one.

A command that needs one calls `require` before any work, so a missing package ends the command with one line
naming the extra to install (exit 2), never with a traceback half-way through.
"""
from __future__ import annotations

import importlib
from types import ModuleType

DISTRIBUTION = "lantern-decoding"

# import name -> (package on the index, the extra that installs it by default)
EXTRAS = {
    "sklearn": ("scikit-learn", "eval"),  # the embedded digits data: `eval` (and `train`, which also has it)
    "onnx": ("onnx", "onnx"),
    "onnxruntime": ("onnxruntime", "onnx"),
    "transformers": ("transformers", "families"),  # model-family folders; T5 prompts take it from `t2i`
}


class MissingExtra(ValueError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def install_hint(module: str, extra: str | None = None) -> str:
    """'<package> is not installed: pip install '<distribution>[<extra>]''"""
    package, default_extra = EXTRAS[module]
    return f"{package} is not installed: pip install '{DISTRIBUTION}[{extra or default_extra}]'"


def require(module: str, needed_for: str, extra: str | None = None) -> ModuleType:
    """Import `module` (a key of EXTRAS) or raise MissingExtra saying what needs it and which extra (default: the
    module's own in EXTRAS) installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:  # also a module blocked as sys.modules[name] = None
        raise MissingExtra(f"{needed_for} needs {EXTRAS[module][0]}; {install_hint(module, extra)}") from None


def available(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
