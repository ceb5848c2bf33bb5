"""Checks of command-line input shared by every `lantern` command, so bad input fails before any work.

`number(...)` is an argparse `type` for bounded ints and finite floats; `Parser` reports a bad flag as a
`UsageError` (exit code 2, one JSON object with --json) instead of exiting; each names the bad value and what is
allowed. `expected_failure` says how a command that failed ends (a signal: lantern.cli.signals). (Output locations
that cannot be written are found by lantern.files.atomic_io.check_writable.) Nothing here imports torch, so
`lantern --help` stays quick.
"""
from __future__ import annotations

import argparse
import errno
import math
import sys
from typing import Callable


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
    return f"{what} <= {high}" if high is not None else what


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


FLAGS_FOR_MEMORY = {"generate": "--batch (images per step), fewer --classes or a smaller --scale",
                    "eval": "--batch (images per step)", "profile": "the batch sizes measured"}
FILESYSTEM_ERRORS = {getattr(errno, name) for name in ("ENAMETOOLONG", "ENOSPC", "EDQUOT", "EACCES", "EPERM", "EROFS",
                                                      "ENOTDIR", "EISDIR", "EEXIST", "ENOENT")
                     if hasattr(errno, name)}  # (EDQUOT is not defined everywhere)


def expected_failure(e: Exception, args) -> str:
    """The message for a failure that is the request's or the machine's, not lantern's (exit 2): memory that
    cannot be allocated for the requested size (naming the flag to change), a file the filesystem refuses. ''
    for anything else (lantern's own bug)."""
    torch = sys.modules.get("torch")  # not loaded: no torch allocation could have failed
    text = str(e)
    if isinstance(e, MemoryError) or (torch is not None and isinstance(e, torch.OutOfMemoryError)) or (
            isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())):
        flag = FLAGS_FOR_MEMORY.get(getattr(args, "command", ""), "the request's size")
        detail = text.splitlines()[0][:200] if text else type(e).__name__
        return f"not enough memory for this request ({detail}); lower {flag}"
    if isinstance(e, OSError) and e.errno in FILESYSTEM_ERRORS:
        where = f" {e.filename}" if e.filename else ""
        return f"cannot use{where}: {e.strerror or e}"
    return ""
