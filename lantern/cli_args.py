"""Checks of command-line input shared by every `lantern` command, so bad input fails before any work.

`number(...)` is an argparse `type` for bounded ints and finite floats; `check_writable(...)` finds an output
location that cannot be written before anything is generated; `Parser` reports a bad flag as a `UsageError`
(exit code 2, one JSON object with --json) instead of exiting. Each names the bad value and what is allowed.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional


class UsageError(ValueError):
    """Bad input found by the command line itself (reported like any ValueError: exit code 2)."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors raise UsageError, so `lantern.cli.main` reports them as it reports every bad input.
    Subcommand parsers inherit it."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}")


def describe_range(kind: type, low, high, low_open: bool) -> str:
    what = "an integer" if kind is int else "a finite number"
    if low is not None and high is not None:
        return f"{what} in {'(' if low_open else '['}{low}, {high}]"
    if low is not None:
        return f"{what} {'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{what} <= {high}"
    return what


def number(kind: type = float, low=None, high=None, low_open: bool = False) -> Callable[[str], float]:
    """An argparse `type`: `kind` (int or float) in [low, high] ((low, high] with low_open); nan and inf are
    refused, and the message names the flag (argparse adds it), the value and what is allowed."""
    allowed = describe_range(kind, low, high, low_open)

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}; "
                                             f"allowed: {allowed}") from None
        below = low is not None and (value < low or (low_open and value == low))
        above = high is not None and value > high
        if not math.isfinite(value) or below or above:
            raise argparse.ArgumentTypeError(f"{text} is not allowed; allowed: {allowed}")
        return value

    parse.__name__ = allowed  # what argparse names in its own messages
    return parse


def check_writable(path: Path, what: str, folder: bool) -> None:
    """Raise ValueError unless `path` (a folder, or a file when not `folder`) can be created or written.
    The nearest existing ancestor gets one probe file, removed at once, so nothing is left behind."""
    path = Path(path)
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
