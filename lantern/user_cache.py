"""The user's cache folder for what lantern measures or builds once per machine or model: exported ONNX graphs,
`--method auto`'s latency calibrations and acceptance records.

$LANTERN_CACHE_DIR, else the platform's user cache folder for lantern (platformdirs: $XDG_CACHE_HOME/lantern or
~/.cache/lantern on Linux, ~/Library/Caches/lantern on macOS, %LOCALAPPDATA%\\lantern\\Cache on Windows).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import platformdirs

CACHE_ENV = "LANTERN_CACHE_DIR"


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(platformdirs.user_cache_dir("lantern", appauthor=False))


def read_json(path: Path) -> Optional[dict]:
    """The cached object, or None when missing or unreadable (a corrupt cache entry is measured again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict) -> None:
    """Atomic: a crash mid-write never leaves half an entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
