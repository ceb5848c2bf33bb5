"""lantern: speculative decoding (EAGLE-2, LANTERN, LANTERN++, speculative Jacobi decoding) for LlamaGen-style
visual autoregressive image generators, on swappable backends. The Python API is `lantern.api.Pipeline`; the
command line is `lantern`."""
import importlib
import tomllib
from importlib import metadata
from pathlib import Path


def _version() -> str:
    """The installed distribution's version, or pyproject.toml's in a source checkout that was never installed."""
    try:
        return metadata.version("lantern-decoding")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


__version__ = _version()

# The stable public API, importable from the package itself (loaded on first use, so `import lantern` stays
# light and no import cycle forms with lantern.backends).
_PUBLIC = {
    "Pipeline": "lantern.api", "GenerationResult": "lantern.api", "ModelDefaults": "lantern.api",
    "Choice": "lantern.plan.choose",
    "load_bundle": "lantern.bundle",
    "DecodeConfig": "lantern.decoding", "SamplingConfig": "lantern.decoding", "method_preset": "lantern.decoding",
    "METHODS": "lantern.decoding", "GenerationStats": "lantern.decoding",
    "get_backend": "lantern.backends", "StaticSpec": "lantern.backends",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lantern' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
