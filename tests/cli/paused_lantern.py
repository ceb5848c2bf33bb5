"""`python paused_lantern.py PAUSE ARGS...`: `python -m lantern.cli ARGS...` held at one point of its life, so a test
signals it exactly there (tests/cli/test_signals.py) whatever the machine's speed. It writes `paused at PAUSE` on
stderr once it waits there. PAUSE:

    import:MODULE   the first import of MODULE (import:torch: amid the command's own imports, its first second)
    exit            the command done, the interpreter ending the process (a thread the exit waits for holds it)
    call:MODULE:NAME:N
                    the Nth call of MODULE's function NAME (a dotted name for a method: Image.save), at its entry
                    (the module is imported first and the name replaced in it, where callers look it up)

A call held in another thread than the main one (the service's engine worker) is not ended by a signal: with
$PAUSED_LANTERN_RELEASE naming a file, the held call goes on once the test creates that file.
"""
import functools
import importlib
import os
import runpy
import sys
import threading
import time

HOLD_S = 3600  # far longer than any test waits: the signal the test sends ends the hold
RELEASE_ENV = "PAUSED_LANTERN_RELEASE"


def say_paused(where: str) -> None:
    sys.stderr.write(f"paused at {where}\n")
    sys.stderr.flush()


def pause_at_import(module: str) -> None:
    paused = []

    def hook(event: str, args: tuple) -> None:
        if event == "import" and args[0] == module and not paused:
            paused.append(module)
            say_paused(f"import:{module}")
            time.sleep(HOLD_S)  # in the main thread: the signal's handler runs here
    sys.addaudithook(hook)


def pause_at_exit() -> None:
    def hold() -> None:
        threading.main_thread().join()  # returns once the interpreter's exit has begun
        say_paused("exit")
        time.sleep(HOLD_S)  # a thread that is no daemon: the exit waits for it
    threading.Thread(target=hold, name="paused-at-exit").start()


def hold_call() -> None:
    """Until the signal the test sends (its handler runs in the main thread, here), or until the release file the
    test names exists."""
    release = os.environ.get(RELEASE_ENV)
    deadline = time.monotonic() + HOLD_S
    if not release:
        time.sleep(HOLD_S)  # in the main thread: the signal's handler runs here
    while release and not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)


def pause_at_call(where: str) -> None:
    module_name, qualname, nth = where.split(":")
    *owners, name = qualname.split(".")
    owner = importlib.import_module(module_name)
    for attribute in owners:
        owner = getattr(owner, attribute)
    original, calls = getattr(owner, name), []

    @functools.wraps(original)
    def held(*args, **kwargs):
        calls.append(None)
        if len(calls) == int(nth):
            say_paused(f"call:{where}")
            hold_call()
        return original(*args, **kwargs)
    setattr(owner, name, held)


if __name__ == "__main__":
    pause, args = sys.argv[1], sys.argv[2:]
    if pause == "exit":
        pause_at_exit()
    elif pause.startswith("call:"):
        pause_at_call(pause.removeprefix("call:"))
    else:
        pause_at_import(pause.removeprefix("import:"))
    sys.argv = ["lantern", *args]
    runpy.run_module("lantern.cli", run_name="__main__", alter_sys=True)
