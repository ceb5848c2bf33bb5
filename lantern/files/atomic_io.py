"""Writes that never leave half a file: every file or folder lantern writes (images, grids, results, cache
entries, exported graphs, checkpoints) is built under a temporary name in its destination's folder, flushed to
disk, then renamed over the destination in one step. A reader sees the old file or the new one, never a part.

A run stopped by a signal (Ctrl-C, SIGTERM: an exception between any two instructions) removes its temporary:
each temporary is named before it is created, inside the block that removes it. A run killed outright leaves it
behind: `.<name>.lantern-<pid>-<number><random>.tmp`. `remove_stale(folder)`
deletes those of processes no longer running on this host (or older than STALE_AFTER_S, for a folder shared by
hosts); every writer of lantern's caches and outputs calls it for its folder before writing.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
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


_WRITES = itertools.count()  # numbers this process's temporaries


def temp_name(path: Path) -> Path:
    """A name beside `path` for a temporary that no other write uses: the process id tells this host's processes
    apart, the number this process's writes, the random part the hosts sharing a folder."""
    return path.parent / f"{temp_prefix(path)}{next(_WRITES) % 10 ** 6:06d}{secrets.token_hex(3)}{TEMP_SUFFIX}"


def _create_file(path: Path) -> None:
    """An empty file, never an existing one, with the mode a plain open() gives (readable by the other users of a
    shared cache or output folder)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
    tmp = temp_name(path)
    try:  # entered before the temporary exists, so that a stop at any instruction removes it
        _create_file(tmp)
        yield tmp
        _fsync(tmp)
        _replace(tmp, path)
    except BaseException:
        _remove(tmp)
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
    existing one is moved aside first, then removed), on any error it is removed and an existing `folder` is
    left as it was (put back, when the error came between moving it aside and the swap)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp, aside = temp_name(folder), temp_name(folder)
    try:  # entered before either temporary exists, so that a stop at any instruction removes them
        os.mkdir(tmp)  # the mode a plain mkdir gives
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        _fsync(tmp, directory=True)
        if folder.exists():  # a folder cannot be renamed over a non-empty one: move it aside, then swap
            os.mkdir(aside)
            os.replace(folder, aside / folder.name)
        _replace(tmp, folder)
        _remove(aside)  # here, not in a `finally`: a stop there would skip it
    except BaseException:
        _remove(tmp)
        if (aside / folder.name).exists() and not folder.exists():
            os.replace(aside / folder.name, folder)
        _remove(aside)
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
    overhead = len(temp_name(path).name) - len(path.name)  # what the temporary's name adds (ASCII)
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
    The nearest existing ancestor gets one probe file, removed at once (see probe_writable)."""
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
        probe_writable(base)
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be written: {base} is not writable ({e.strerror})") from None


def probe_writable(folder: Path) -> None:
    """Create one empty file in `folder` and remove it, whatever stops this in between; raises the OSError that
    says why `folder` cannot be written."""
    probe = temp_name(folder / "write-probe")
    try:
        _create_file(probe)
        _remove(probe)  # here, not in a `finally`: a stop there would skip it
    except BaseException:
        _remove(probe)
        raise
