"""The user's cache folder for what lantern measures or builds once per machine or model: exported ONNX graphs,
`--method auto`'s latency calibrations and acceptance records.

$LANTERN_CACHE_DIR, else the platform's user cache folder for lantern (platformdirs; docs/install.md). A location
that cannot be used (a file, read-only, not creatable, a HOME that does not exist) is refused before any work
(`check_location`, exit 2).

Every entry is measured by one process at a time (`entry_lock`: the others wait, then read what it stored),
written atomically (lantern.files.atomic_io), and checked when read (`read_entry`): an entry that cannot be read
as UTF-8 JSON (a folder in its place included) or is not of its kind's shape is named on stderr, moved aside to
`<name>.corrupt-<UTC time>` and measured again. See docs/reliability.md.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import platformdirs
from filelock import FileLock, Timeout

from lantern.files import atomic_io
from lantern.files.reading import UnreadableFile, read_json

CACHE_ENV = "LANTERN_CACHE_DIR"


class CacheUnusable(ValueError):
    """A cache location that cannot be used (reported as bad input: exit code 2, before any work)."""


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    try:
        Path.home()
    except RuntimeError:  # no HOME and no passwd entry
        raise CacheUnusable(f"no cache folder: HOME is not set; set {CACHE_ENV} to a writable folder") from None
    return Path(platformdirs.user_cache_dir("lantern", appauthor=False))


def cache_source() -> str:
    """Which variable the cache folder comes from, to name in a message."""
    if os.environ.get(CACHE_ENV):
        return CACHE_ENV
    return "XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else f"HOME ({os.environ.get('HOME', 'unset')})"


def check_location(folder: Path, variable: str) -> Path:
    """Create `folder` if needed and prove it writable (one probe file, removed at once); raise CacheUnusable
    naming the variable it comes from, the path and why not. Returns the folder."""
    folder = Path(folder)
    derived = variable == "XDG_CACHE_HOME" or variable.startswith("HOME")  # not a folder the user named for lantern
    hint = f" (set {CACHE_ENV} to a writable folder)" if derived else ""
    if folder.exists() and not folder.is_dir():
        raise CacheUnusable(f"cache folder {folder} (from {variable}) is a file, not a folder{hint}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_io.probe_writable(folder)
    except OSError as e:
        raise CacheUnusable(f"cache folder {folder} (from {variable}) cannot be used: "
                            f"{e.strerror or e}{hint}") from None
    return folder


def usable_root() -> Path:
    """The cache folder, checked (see check_location)."""
    return check_location(cache_root(), cache_source())


def entry_folder(kind: str) -> Path:
    """`<cache>/<kind>`, created, with the temporaries of killed runs removed."""
    folder = check_location(usable_root() / kind, cache_source())
    atomic_io.remove_stale(folder)
    return folder


@contextmanager
def entry_lock(path: Path, what: str) -> Iterator[None]:
    """Hold `<path>.lock` (released by the OS if this process dies): one process measures an entry at a time.
    A process that must wait says so once, then waits."""
    lock = FileLock(f"{path}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"lantern: waiting for another lantern process measuring {what} ({path})", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def move_aside(path: Path, problem: str) -> None:
    """Name a bad entry on stderr and rename it to `<name>.corrupt-<UTC time>` (kept for a bug report)."""
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    try:
        os.replace(path, aside)
        where = f"moved aside to {aside.name}"
    except OSError as e:
        where = f"could not be moved aside ({e.strerror or e})"
    print(f"lantern: cache entry {path} {problem}; {where}, measuring it again", file=sys.stderr)


def read_entry(path: Path, problem: Callable[[dict], str]) -> Optional[dict]:
    """The cached object, or None when missing, unreadable or malformed (then named and moved aside, so it is
    measured again). problem(data) -> '' when `data` (a dict) has its kind's shape, else what is wrong."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        return None
    except UnreadableFile as e:
        move_aside(path, e.problem)
        return None
    wrong = problem(data) if isinstance(data, dict) else f"must be a JSON object, got {type(data).__name__}"
    if wrong:
        move_aside(path, f"is malformed: {wrong}")
        return None
    return data


def write_entry(path: Path, data: dict) -> None:
    """Atomic: a crash mid-write never leaves half an entry."""
    atomic_io.write_json(path, data)


# -- shape checks shared by the kinds of entries ------------------------------------------------------------------
def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x not in (float("inf"),
                                                                                           float("-inf"))


def field_problem(data: dict, name: str, kind: type | tuple) -> str:
    """'' if data[name] is present and of `kind`, else what is wrong with it."""
    if name not in data:
        return f"field {name!r} is missing"
    value = data[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        return f"field {name!r} must be {names}, got {type(value).__name__}"
    return ""
