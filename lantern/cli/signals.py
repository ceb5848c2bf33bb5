"""How `lantern` answers SIGINT and SIGTERM at every moment of a command, imports to exit (docs/reliability.md):
128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM, the shell's convention), one line on stderr, nothing
half-written.

- While the command works, its imports included, the signal raises Stopped where the main thread is. Its writes
  are atomic, so unwinding leaves no part of a file; a signal while it unwinds is not raised again, so the
  clean-up completes.
- While its answer is written (its output, or the line saying why it failed), the signal waits: the answer is
  written whole, then the signal is passed on to the handler the command found (in a process of its own: the next
  rule).
- Once the answer is out and the process only ends (`lantern.cli.run`), the signal ends it at once: 128 + its
  number and its line, or the answer's own code and no second line when the answer was already a stop's.

`lantern serve` answers the signals itself while it listens (drain, cancel, close: lantern.cli.serve); before and
after, these rules hold. A process keeps them to its exit itself: the interpreter's teardown would put back the
operating system's defaults (killed, no line), so it ends from its last exit function, once its threads were
joined and the other exit functions ran. Only the start before `run` (the interpreter's, and lantern.cli's light
imports) is the operating system's.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import NoReturn, Optional

NAMES = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)"}
STOP_CODES = {128 + sig for sig in NAMES}


class Stopped(BaseException):
    """Ctrl-C (SIGINT) or SIGTERM: the command stops where it is. code: 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(f"{NAMES[signum]}; stopped, nothing half-written")
        self.code = 128 + signum


class _Answers:
    """Where the command is, for its signals (one per process, as signals are)."""

    def __init__(self):
        self.phase = "working"  # "working", "writing" (its answer), "answered"
        self.stopped: Optional[int] = None  # the signal that raised Stopped
        self.held: list[int] = []  # signals that waited: while the answer was written, or while it unwound
        self.code: Optional[int] = None  # the answer's exit code, once written
        self.owns_process = False  # lantern.cli.run: the process ends when the answer is out

    def handle(self, signum: int, frame) -> None:
        if self.phase == "answered" and self.owns_process:
            self.leave_now(signum)
        if self.phase != "working" or self.stopped is not None:
            self.held.append(signum)
            return
        self.stopped = signum
        raise Stopped(signum)

    def leave_now(self, signum: int) -> NoReturn:
        """End the process with the signal's answer: its line and 128 + its number, unless the answer was a stop."""
        code = self.code
        if code not in STOP_CODES:
            code = 128 + signum
            os.write(2, f"lantern: error: {Stopped(signum)}\n".encode())  # no buffered stream: the answer is out
        os._exit(code)

    def end(self) -> None:
        """The process's last exit function: leave with the answer's code before the interpreter's teardown, where
        a signal would meet the operating system's defaults."""
        if self.code is None:  # not ended by lantern.cli.run: the interpreter ends it
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more reaches it
                pass
        os._exit(self.code)


_answers = _Answers()


@contextmanager
def answering_signals():
    """Within: SIGINT and SIGTERM answered as this module says (in the main thread; elsewhere nothing changes).
    Leaving puts back the handlers it found and passes on to them a signal that waited for the answer."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _answers.phase, _answers.stopped, _answers.held, _answers.code = "working", None, [], None
    previous = {sig: signal.signal(sig, _answers.handle) for sig in NAMES}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if _answers.held and _answers.stopped is None:
            signal.raise_signal(_answers.held[0])


def raise_if_stopped() -> None:
    """Raise the Stopped a signal raised if something caught it (a library's bare except): the command still stops."""
    if _answers.stopped is not None:
        raise Stopped(_answers.stopped)


@contextmanager
def writing_answer(code: int):
    """Within: the command's answer (exit code `code`) is written; a signal waits until it is whole."""
    _answers.phase = "writing"
    try:
        yield
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        _answers.phase, _answers.code = "answered", code


def answer_until_exit() -> None:
    """From now to the process's end, these rules answer its signals (the process entry, lantern.cli.run)."""
    _answers.owns_process = True
    signal.signal(signal.SIGINT, _answers.handle)
    signal.signal(signal.SIGTERM, _answers.handle)
    atexit.register(_answers.end)  # the first registered: the last run


def exit_with(code: int) -> NoReturn:
    """End the process with `code`: its threads joined and exit functions run by the interpreter, then `end`."""
    _answers.phase, _answers.code = "answered", code
    sys.exit(code)
