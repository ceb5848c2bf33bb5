"""Faults that need processes of their own (docs/reliability.md): two first runs on one cache at once, and
SIGINT / SIGTERM / SIGKILL during generation, calibration and export. Afterwards every file present opens, no
temporary is left by a stopped run, and the next run succeeds. The victims of one phase run side by side on the
tiny bundle (tests/tiny_bundle.py), to keep the suite's time down."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from lantern.plan import calibration, deciding

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_bundle import write_tiny_bundle  # noqa: E402

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signals (SIGKILL) and process semantics")
TIMEOUT_S = 240  # a loaded CI machine is slow; a hung process fails the test instead of hanging it
STOPS = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -signal.SIGKILL}
PAUSED = Path(__file__).with_name("paused_lantern.py")


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    return write_tiny_bundle(tmp_path_factory.mktemp("tiny-bundle"), drafter_too=False)


class Lantern:
    """`lantern *args` in a process of its own; its stderr goes to a file the test polls."""

    def __init__(self, tmp: Path, name: str, *args, code: str = "", pause: str = "", **env):
        """code: Python the process runs instead of `python -m lantern.cli` (it then runs lantern.cli itself);
        pause: where paused_lantern.py holds the process (a test signals it there, whatever the machine's speed)."""
        self.err_path = tmp / f"{name}.stderr"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2]), **env}
        command = ["-c", code] if code else [str(PAUSED), pause] if pause else ["-m", "lantern.cli"]
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, *command, *args], stdout=subprocess.DEVNULL,
                                         stderr=err, env=full_env)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_until(self, ready, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready():
            assert self.proc.poll() is None, f"ended ({self.proc.returncode}) before {what}: {self.stderr[-2000:]}"
            assert time.monotonic() < deadline, f"no {what} in {TIMEOUT_S} s"
            time.sleep(0.02)

    def wait(self) -> int:
        return self.proc.wait(timeout=TIMEOUT_S)


def temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if ".lantern-" in p.name and p.name.endswith(".tmp")]


def check_stopped(victims: dict) -> None:
    """Each victim (signal -> Lantern) exits with its code; a stopped one (not killed) says so in one line."""
    for sig, victim in victims.items():
        code = victim.wait()
        assert code == STOPS[sig], (sig, code, victim.stderr[-2000:])
        if sig != signal.SIGKILL:
            last = victim.stderr.strip().splitlines()[-1]
            assert "Traceback" not in victim.stderr and last.startswith("lantern: error: ")
            assert ("interrupted (Ctrl-C)" if sig == signal.SIGINT else "terminated (SIGTERM)") in last


# `lantern` with every timing taken as undisturbed: the disturbance check is tests/cli/test_faults.py's, and here
# the load of the machine must not make a second measurement legitimate (nor a test skip)
UNDISTURBED = ("from lantern.plan import calibration; calibration.disturbance = lambda entry: ''; "
               "from lantern.cli import run; run()")


def test_concurrent_first_runs_measure_once_and_store_what_a_solo_run_stores(tmp_path, bundle_dir, monkeypatch):
    """Two first runs on one cache (processes, started together): exactly one measures the acceptance record and
    exactly one the calibration, while the other waits for its lock and then reads them. What the shared cache
    holds is what a run alone stores: the same acceptance record, word for word (its measurement is seeded), and
    a whole calibration of the same plans at the same widths (their seconds are the machine's, not compared).
    Both refine a first-run probe in full."""
    probe = seed_probe_to_refine(bundle_dir, [tmp_path / "shared", tmp_path / "solo"], monkeypatch)
    args = ("generate", "--model", str(bundle_dir), "--classes", "1", "--no-images")
    # measuring is what is tested, not its budget: the tiny bundle's one-image request would not pay for it
    budget = {calibration.BUDGET_ENV: "1", deciding.SHARE_ENV: "inf"}
    runs = [Lantern(tmp_path, f"run{i}", *args, code=UNDISTURBED, LANTERN_CACHE_DIR=str(tmp_path / "shared"),
                    **budget) for i in range(2)]
    assert [r.wait() for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    errs = [r.stderr for r in runs]
    assert sum("calibrating" in e for e in errs) == 1, errs
    assert sum("measuring the acceptance" in e for e in errs) == 1, errs
    solo = Lantern(tmp_path, "solo", *args, code=UNDISTURBED, LANTERN_CACHE_DIR=str(tmp_path / "solo"), **budget)
    assert solo.wait() == 0, solo.stderr[-2000:]
    assert "calibrating" in solo.stderr and "measuring the acceptance" in solo.stderr

    def stored(cache: Path) -> tuple[dict, dict]:
        (path,) = (cache / "calibration").glob("*.json")
        assert path.read_text() != probe  # refined, and stored
        records = {p.relative_to(cache).as_posix(): json.loads(p.read_text())
                   for p in (cache / "records").rglob("*.json")}
        return json.loads(path.read_text()), records
    (shared, shared_records), (alone, alone_records) = stored(tmp_path / "shared"), stored(tmp_path / "solo")
    assert shared_records and shared_records == alone_records
    assert calibration.calibration_problem(shared) == "" and shared["key"] == alone["key"]
    assert set(shared["widths"]) == set(alone["widths"]) == {"1"}
    for width, entry in shared["widths"].items():
        assert "provisional" not in entry and "provisional" not in alone["widths"][width]
        assert set(entry["plans"]) == set(alone["widths"][width]["plans"]), (entry, alone["widths"][width])


def seed_acceptance_record(bundle_dir: Path, caches: list[Path], monkeypatch) -> None:
    """Measure the bundle's acceptance record once, here, and copy it into each cache: the victims of a stopped
    calibration go straight to calibrating."""
    import shutil

    from lantern.api import Pipeline
    from lantern.bundle import load_bundle
    from lantern.plan.candidates import candidate_plans
    from lantern.plan.choose import runnable, steps_by_plan
    first = caches[0]
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(first))
    pipe = Pipeline.from_bundle(load_bundle(bundle_dir), backend="cpu")
    sampling = pipe.defaults.sampling
    plans, _ = runnable(pipe, candidate_plans(False, False), sampling, 1)
    steps_by_plan(pipe, plans, sampling, pipe.model_key, False, [None])
    for cache in caches[1:]:
        shutil.copytree(first / "records", cache / "records")


def seed_probe_to_refine(bundle_dir: Path, caches: list[Path], monkeypatch) -> str:
    """A first-run probe's (provisional) calibration in each cache whose AR is predicted to take 100 s: the next
    request pays for refining it in full, a calibration long enough to be stopped midway. Returns its text."""
    from lantern.api import Pipeline
    from lantern.bundle import load_bundle
    from lantern.plan.candidates import candidate_plans
    from lantern.plan.choose import runnable
    monkeypatch.setenv("LANTERN_CACHE_DIR", str(caches[0]))
    pipe = Pipeline.from_bundle(load_bundle(bundle_dir), backend="cpu")
    plans, _ = runnable(pipe, candidate_plans(False, False), pipe.defaults.sampling, 1)
    key = calibration.pipe_key(pipe, pipe.defaults.sampling)
    data = {"key": key, "widths": {"1": {"fixed_s": 100.0, "provisional": True,
                                         "plans": {p.name: {"step_s": 1e-3} for p in plans}}}}
    for cache in caches:
        monkeypatch.setenv("LANTERN_CACHE_DIR", str(cache))
        calibration.save_calibration(data)
    return calibration.calibration_path(key).read_text()


@pytest.mark.slow
def test_stopped_generation_and_calibration_leave_whole_files_and_a_usable_cache(tmp_path, bundle_dir, monkeypatch):
    """Stopped while writing images, or while calibrating (refining a first-run probe in full): every PNG present
    opens, every cache entry present is whole and of its shape (the stopped calibration stored nothing), a stopped
    run leaves no temporary, and the next run into the killed ones' folder and cache succeeds: it calibrates (the
    killed run's lock does not hold it) and clears the temporaries the kill left."""
    classes = [str(c % 4) for c in range(4)]
    second_image = "call:PIL.Image:Image.save:2"  # the first PNG written whole, the next one's temporary begun
    caches = [tmp_path / f"cache-{sig.name}" for sig in STOPS]
    seed_acceptance_record(bundle_dir, caches, monkeypatch)
    probe = seed_probe_to_refine(bundle_dir, caches, monkeypatch)
    writers = {}
    for sig in STOPS:
        out = tmp_path / f"out-{sig.name}"
        writers[sig] = Lantern(tmp_path, f"write-{sig.name}", "generate", "--model", str(bundle_dir), "--method",
                               "ar", "--classes", *classes, "--scale", "16", "--out", str(out), pause=second_image,
                               LANTERN_CACHE_DIR=str(tmp_path / "unused"))
    for sig, writer in writers.items():
        writer.wait_until(lambda: f"paused at {second_image}" in writer.stderr, "image written")
        out = tmp_path / f"out-{sig.name}"
        assert len(list(out.glob("*.png"))) == 1 and temporaries(out)
        writer.proc.send_signal(sig)
    check_stopped(writers)
    first_timing = "call:lantern.plan.calibration:_step_seconds:1"  # the calibration's first timed run
    calibrators = {sig: Lantern(tmp_path, f"calibrate-{sig.name}", "generate", "--model", str(bundle_dir),
                                "--classes", "1", "--no-images", pause=first_timing,
                                LANTERN_CACHE_DIR=str(tmp_path / f"cache-{sig.name}"),
                                # stopped while refining in full: a share of deciding that lets the first request
                                # refine
                                **{calibration.BUDGET_ENV: "60", deciding.SHARE_ENV: "inf"})
                   for sig in STOPS}
    for sig, calibrator in calibrators.items():
        calibrator.wait_until(lambda: f"paused at {first_timing}" in calibrator.stderr, "calibration under way")
        assert "calibrating 1 image(s) per step" in calibrator.stderr
        calibrator.proc.send_signal(sig)
    check_stopped(calibrators)
    assert all("per step, in full" in c.stderr for c in calibrators.values())  # refining, not a probe
    for sig in STOPS:
        out, cache = tmp_path / f"out-{sig.name}", tmp_path / f"cache-{sig.name}"
        for png in out.glob("*.png"):
            with Image.open(png) as im:
                im.load()  # a half-written PNG raises here
        assert not list(cache.rglob("*.corrupt-*"))
        assert [p.read_text() for p in (cache / "calibration").glob("*.json")] == [probe]  # not replaced
        for path in cache.rglob("*.json"):
            json.loads(path.read_text())
        if sig != signal.SIGKILL:
            assert temporaries(out) == [] and temporaries(cache) == []
    again = Lantern(tmp_path, "again", "generate", "--model", str(bundle_dir), "--classes", "1", "--out",
                    str(tmp_path / "out-SIGKILL"), LANTERN_CACHE_DIR=str(tmp_path / "cache-SIGKILL"),
                    **{calibration.BUDGET_ENV: "1"})
    assert again.wait() == 0, again.stderr[-2000:]
    assert "waiting for another lantern process" not in again.stderr and "calibrating" in again.stderr
    assert temporaries(tmp_path / "out-SIGKILL") == [] and temporaries(tmp_path / "cache-SIGKILL") == []


@pytest.mark.slow
def test_stopped_export_leaves_whole_graphs(tmp_path):
    """Stopped while exporting ONNX graphs (held at the second graph's export, the first one whole): every graph
    folder present matches its manifest, no temporary folder is left by a stopped run, and the next export into the
    killed one's folder succeeds and clears it."""
    from lantern.backends.onnx_export import MANIFEST, folder_sha256
    second_graph = "call:lantern.backends.onnx_export:export_graph:2"

    def export(name: str, out: Path, pause: str = "") -> Lantern:
        return Lantern(tmp_path, name, "export-onnx", "--preset", "GPT-test", "--method", "ar", "--cfg-scale",
                       "1", "--batch", "1", "--out", str(out), pause=pause)
    victims = {sig: export(sig.name, tmp_path / sig.name, second_graph) for sig in STOPS}
    for sig, victim in victims.items():
        out = tmp_path / sig.name
        victim.wait_until(lambda: f"paused at {second_graph}" in victim.stderr, "export under way")
        assert temporaries(out) and list(out.glob(f"*/{MANIFEST}"))  # one graph whole, the next one under way
        victim.proc.send_signal(sig)
    check_stopped(victims)
    for sig in STOPS:
        out = tmp_path / sig.name
        for manifest in out.glob(f"*/{MANIFEST}"):
            assert json.loads(manifest.read_text())["sha256"] == folder_sha256(manifest.parent)
        if sig != signal.SIGKILL:
            assert temporaries(out) == []
    again = export("again", tmp_path / "SIGKILL")
    assert again.wait() == 0, again.stderr[-2000:]
    assert temporaries(tmp_path / "SIGKILL") == []



def test_a_signal_a_library_swallowed_still_stops_the_command():
    """SIGINT raises Stopped where the main thread is; a library that catches everything (a bare except) there
    must not turn the stop into a success: the command still ends Stopped, 130, once its work is done."""
    import os

    from lantern.cli.signals import Stopped, answering_signals, raise_if_stopped
    with pytest.raises(Stopped) as stop, answering_signals():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
        except BaseException:  # noqa: BLE001  the library's bare except, as some do
            pass
        raise_if_stopped()
    assert stop.value.code == 130 and "interrupted (Ctrl-C)" in str(stop.value)


def test_a_second_signal_while_a_stop_unwinds_lets_the_clean_up_finish():
    """Ctrl-C, then SIGTERM while the stop unwinds (amid a clean-up, such as a temporary's removal): the clean-up
    completes and the command ends with the first signal's stop."""
    import os

    from lantern.cli.signals import Stopped, answering_signals
    cleaned = []
    with pytest.raises(Stopped) as stop, answering_signals():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            cleaned.append("done")
    assert cleaned == ["done"] and stop.value.code == 130
