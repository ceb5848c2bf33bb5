"""SIGINT and SIGTERM at the moments of a `lantern` process that the work's own handler used not to cover
(docs/reliability.md): amid the command's imports (its first second), while its answer is written, and after it, on
the way out. Each victim is held at its moment by tests/cli/paused_lantern.py and signalled there, so no test depends
on speed. Each answers 130 or 143 with one line on stderr, no traceback, and whole output."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_bundle import write_tiny_bundle  # noqa: E402

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signals and process semantics")
TIMEOUT_S = 240  # a loaded machine is slow; a hung process fails the test instead of hanging it
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
NAMES = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)"}
PAUSED = Path(__file__).with_name("paused_lantern.py")


class Paused:
    """`lantern *args` in a process of its own, held at `pause` (paused_lantern.py); stdout and stderr to files."""

    def __init__(self, tmp: Path, name: str, pause: str, *args):
        self.out_path, self.err_path = tmp / f"{name}.stdout", tmp / f"{name}.stderr"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(PAUSED), pause, *args], stdout=out, stderr=err,
                                         env=env)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_until(self, text: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while text not in self.stderr:
            assert self.proc.poll() is None, f"ended ({self.proc.returncode}) before {text!r}: {self.stderr[-2000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in {TIMEOUT_S} s"
            time.sleep(0.02)

    def signal_at(self, pause: str, sig: int) -> None:
        self.wait_until(f"paused at {pause}")
        self.proc.send_signal(sig)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def answering(url: str, victim: Paused) -> None:
    """Wait until the service at `url` answers HTTP (any status)."""
    import httpx
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            httpx.get(f"{url}/health", timeout=5)
            return
        except httpx.TransportError:
            assert victim.proc.poll() is None, f"ended ({victim.proc.returncode}): {victim.stderr[-2000:]}"
            assert time.monotonic() < deadline, f"{url} did not answer in {TIMEOUT_S} s"
            time.sleep(0.05)


def check_answer(victim: Paused, sig: int) -> list[str]:
    """The victim ends with the signal's code and one line of lantern's on stderr, naming the signal, and no
    traceback. Returns lantern's lines."""
    code = victim.wait()
    err = victim.stderr
    assert code == CODES[sig], (sig, code, err[-2000:])
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    said = [line for line in err.splitlines() if line.startswith("lantern")]
    assert said == [f"lantern: error: {NAMES[sig]}; stopped, nothing half-written"], err[-2000:]
    return said


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    return write_tiny_bundle(tmp_path_factory.mktemp("tiny-bundle"), drafter_too=False)


@pytest.mark.slow
def test_a_signal_amid_the_commands_imports_stops_it_with_its_code_and_one_line(tmp_path, bundle_dir):
    """Signalled while torch is being imported (before the command parsed its flags): 130 / 143, one line, and
    with --json the error's JSON object."""
    victims = {sig: Paused(tmp_path, sig.name, "import:torch", "generate", "--model", str(bundle_dir), "--method",
                           "ar", "--classes", "1", "--no-images", "--json") for sig in CODES}
    for sig, victim in victims.items():
        victim.signal_at("import:torch", sig)
    for sig, victim in victims.items():
        check_answer(victim, sig)
        assert json.loads(victim.out_path.read_text()) == {
            "error": f"{NAMES[sig]}; stopped, nothing half-written", "exit_code": CODES[sig]}


@pytest.mark.slow
def test_a_signal_after_the_answer_ends_the_process_with_its_code_and_one_line(tmp_path, bundle_dir):
    """Signalled once the command is done and its JSON written, while the process ends: 130 / 143 with one line at
    once (not killed silently, not a KeyboardInterrupt in the interpreter's exit), the JSON whole."""
    victims = {sig: Paused(tmp_path, sig.name, "exit", "generate", "--model", str(bundle_dir), "--method", "ar",
                           "--classes", "1", "--no-images", "--json") for sig in CODES}
    for sig, victim in victims.items():
        victim.signal_at("exit", sig)
    for sig, victim in victims.items():
        check_answer(victim, sig)
        assert len(json.loads(victim.out_path.read_text())["tokens"]) == 1


def test_a_signal_while_the_answer_is_written_waits_for_it_whole(monkeypatch, capsys):
    """In process: a SIGTERM that comes while `lantern backends` prints its table waits until the table is whole,
    then reaches the handler the caller had (in a process of its own: the exit at once, as above)."""
    from lantern.cli import backends, main
    printed, received = [], []

    def show_with_a_signal_midway(out: dict) -> None:
        print("first half")
        printed.append("first half")
        os.kill(os.getpid(), signal.SIGTERM)
        print("second half")
        printed.append("second half")
    monkeypatch.setattr(backends, "print_backends", show_with_a_signal_midway)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(list(printed)))
    try:
        assert main(["backends"]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [["first half", "second half"]]
    assert capsys.readouterr().out == "first half\nsecond half\n"


@pytest.mark.slow
def test_a_family_services_second_sigterm_after_its_drain_exits_143(tmp_path):
    """A Janus service drains on its first SIGTERM and its command ends (exit 0 to come); a second SIGTERM while
    the process ends is the documented second signal: 143 and one line, not a kill."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    pytest.importorskip("transformers", reason="the families extra (transformers) is not installed")
    from janus_fixtures import make_janus_folder
    folder = tmp_path / "tiny-janus"
    make_janus_folder(folder)
    service = Paused(tmp_path, "serve", "exit", "serve", "--model", str(folder), "--method", "ar", "--batch", "1",
                     "--threads", "1", "--max-prompt-tokens", "12", "--port", "0")
    service.wait_until('"event": "listening"')
    url = next(json.loads(line)["url"] for line in service.stderr.splitlines() if '"event": "listening"' in line)
    answering(url, service)  # uvicorn's handlers (the drain) are in place once it answers
    service.proc.send_signal(signal.SIGTERM)
    service.signal_at("exit", signal.SIGTERM)
    check_answer(service, signal.SIGTERM)
    assert '"event": "stopped", "exit_code": 0' in service.stderr  # the drain ended as documented
