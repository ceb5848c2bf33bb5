"""lantern: speculative decoding (EAGLE-2, LANTERN, LANTERN++) for LlamaGen-style visual autoregressive image
generators, on swappable backends. The Python API is `lantern.api.Pipeline`; the command line is `lantern`."""
from importlib import metadata
from pathlib import Path


def _version() -> str:
    """The installed distribution's version, or pyproject.toml's in a source checkout that was never installed."""
    try:
        return metadata.version("lantern")
    except metadata.PackageNotFoundError:
        import tomllib
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


__version__ = _version()
