"""Writes that never leave half a file: every file or folder lantern writes (images, grids, results, cache
entries, exported graphs, checkpoints) is built under a temporary name in its destination's folder, flushed to
disk, then renamed over the destination in one step. A reader sees the old file or the new one, never a part.

A run killed mid-write leaves its temporary behind: `.<name>.lantern-<pid>-<random>.tmp`. `remove_stale(folder)`
deletes those of processes no longer running on this host (or older than STALE_AFTER_S, for a folder shared by
hosts); every writer of lantern's caches and outputs calls it for its folder before writing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

TEMP_MARK = ".lantern-"
TEMP_SUFFIX = ".tmp"
STALE_AFTER_S = 24 * 3600.0  # a temporary this old is stale whoever made it
_TEMP = re.compile(r"^\..+\.lantern-(\d+)-[^.]*\.tmp$"  # ours
                   r"|^\..+\.tmp(\d+)$")  # ONNX export folders of lantern 0.1.0, which no run removed


def temp_prefix(path: Path) -> str:
    return f".{path.name}{TEMP_MARK}{os.getpid()}-"


def _fsync(path: Path, directory: bool = False) -> None:
    """Flush a file (or a folder's entries) to disk; a no-op where the OS cannot open folders (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _readable_mode(path: Path) -> None:
    """mkstemp makes 0600 files and mkdtemp 0700 folders; give them the mode a plain open() would have, so the
    other users of a shared cache or output folder can read them."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _replace(tmp: Path, destination: Path) -> None:
    """os.replace, whose error names the destination (the temporary is not a name the user knows)."""
    try:
        os.replace(tmp, destination)
    except OSError as e:
        raise type(e)(e.errno, e.strerror, str(destination)) from None


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write the whole file to; on success it replaces `path`, on any
    error (or interrupt) it is removed and `path` is left as it was. For writers that take a path (PIL,
    torch.save, safetensors); the format must not be guessed from the temporary's name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=TEMP_SUFFIX)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _fsync(tmp)
        _readable_mode(tmp)
        _replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent, directory=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, data, indent: int | None = 1, sort_keys: bool = False) -> None:
    write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")


@contextmanager
def atomic_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside `folder` to build it in; on success it takes `folder`'s place whole (an
    existing one is moved aside first, then removed), on any error it is removed."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=temp_prefix(folder), suffix=TEMP_SUFFIX))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        _fsync(tmp, directory=True)
        _readable_mode(tmp)
        old = None
        if folder.exists():  # a folder cannot be renamed over a non-empty one: move it aside, then swap
            old = Path(tempfile.mkdtemp(dir=folder.parent, prefix=temp_prefix(folder), suffix=TEMP_SUFFIX))
            os.replace(folder, old / folder.name)
        _replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(folder.parent, directory=True)


def _running(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # Windows' os.kill ends the process: there, only age counts
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # alive, another user's (or not ours to ask about)
    return True


def remove_stale(folder: str | os.PathLike, now: float | None = None) -> list[Path]:
    """Delete the temporaries in `folder` left by killed runs: their process is gone, or they are older than
    STALE_AFTER_S. Returns what was removed. A folder that does not exist or cannot be listed has none."""
    folder = Path(folder)
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if not m:
            continue
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if _running(int(m.group(1) or m.group(2))) and age < STALE_AFTER_S:
            continue
        path = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def check_fits(path: str | os.PathLike, what: str) -> None:
    """Raise ValueError, naming `what` (the flag that chose the path), unless the filesystem takes `path` and the
    temporary it is written under: each name within NAME_MAX, the whole within PATH_MAX, as the nearest
    existing folder's filesystem says (os.pathconf; 255 and 4096 where it cannot say)."""
    path = Path(os.path.abspath(path))
    base = path.parent
    while not os.path.isdir(base) and base != base.parent:  # os.path: a name too long is "not there", no error
        base = base.parent

    def limit(name: str, default: int) -> int:
        try:
            return os.pathconf(base, name)
        except (OSError, ValueError, AttributeError):
            return default
    name_max, path_max = limit("PC_NAME_MAX", 255), limit("PC_PATH_MAX", 4096)
    overhead = len(temp_prefix(path)) - len(path.name) + 8 + len(TEMP_SUFFIX)  # mkstemp adds 8 characters
    for part in path.parts[1:]:
        longest = len(os.fsencode(part)) + (overhead if part == path.name else 0)
        if longest > name_max:
            raise ValueError(f"{what}: the name {part[:40]}... is {len(os.fsencode(part))} bytes; this filesystem "
                             f"allows {name_max} per name ({name_max - overhead} for a file lantern writes, as it "
                             f"writes it under a temporary name first)")
    if len(os.fsencode(str(path))) + overhead >= path_max:
        raise ValueError(f"{what}: the path {str(path)[:60]}... is {len(os.fsencode(str(path)))} bytes; this "
                         f"filesystem allows {path_max - 1 - overhead} for a file lantern writes")


def check_writable(path: Path, what: str, folder: bool) -> None:
    """Raise ValueError unless `path` (a folder, or a file when not `folder`) can be created or written.
    The nearest existing ancestor gets one probe file, removed at once, so nothing is left behind."""
    path = Path(path)
    check_fits(path, what)
    if path.exists() and folder != path.is_dir():
        raise ValueError(f"{what} {path} exists and is {'not ' if folder else ''}a folder")
    base: Optional[Path] = path if path.exists() and folder else path.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"{what} {path} cannot be written: {base} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".lantern-write-probe-")
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be written: {base} is not writable ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)
