"""Reading the JSON and TOML files lantern is given or keeps (bundle configs and manifests, profiles, results
files, trees, drafter configs, cache entries): one checked reader, so that a file which cannot be read as what
it should hold is refused with its path and what is wrong, never with a decoder's message that names no file.

`UnreadableFile` is a ValueError (the commands answer it with exit 2); a missing file is a FileNotFoundError
naming it. Callers that recover (the user cache moves a bad entry aside and measures it again) read the
problem alone from `UnreadableFile.problem`. See docs/reliability.md.
"""
from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path


class UnreadableFile(ValueError):
    """A file that is a folder, cannot be read, is not UTF-8 text or not of its format; str() names the file."""

    def __init__(self, path: Path, problem: str, what: str = ""):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{what} {path} {problem}" if what else f"{path} {problem}")


def read_text(path: str | Path, what: str = "") -> str:
    """The UTF-8 text of `path`; `what` (e.g. "results file") is said before the path in a refusal."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist" if what else f"{path} does not exist") from None
    except IsADirectoryError:
        raise UnreadableFile(path, "is a folder, not a file", what) from None
    except OSError as e:
        raise UnreadableFile(path, f"cannot be read ({e.strerror or e})", what) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableFile(path, f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})",
                             what) from None


def read_json(path: str | Path, what: str = "") -> object:
    """The JSON value held in `path` (see read_text)."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UnreadableFile(path, f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                             what) from None
    except RecursionError:
        raise UnreadableFile(path, "is not valid JSON (nested too deeply to read)", what) from None


def read_json_object(path: str | Path, what: str = "") -> dict:
    """The JSON object held in `path`; any other JSON value is refused."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise UnreadableFile(path, f"must hold a JSON object, got {type(data).__name__}", what)
    return data


def read_toml(path: str | Path, what: str = "") -> dict:
    """The TOML document held in `path` (see read_text)."""
    text = read_text(path, what)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UnreadableFile(path, f"is not valid TOML ({e})", what) from None


def sha256_file(path: str | Path) -> str:
    """A file's sha256 digest (bundle manifests record one for every file)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
