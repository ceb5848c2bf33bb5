"""Faults around a run (docs/reliability.md): writes that never leave half a file, cache entries that are
corrupt or in a location that cannot be used, and refusals that name their cause before any work. The
commands run in this process (lantern.cli.main) where they can; tests/cli/test_faults_processes.py has the ones
that need processes of their own (concurrent first runs, signals)."""
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lantern.decoding.sampling import SamplingConfig
from lantern.files import atomic_io, images, user_cache
from lantern.cli import main
from lantern.plan import calibration, acceptance_records as records

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_bundle import write_tiny_bundle  # noqa: E402


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    return write_tiny_bundle(tmp_path_factory.mktemp("tiny-bundle"), drafter_too=False)


def run(capsys, *argv) -> tuple[int, str]:
    """Exit code and stderr of `lantern *argv` run here."""
    code = main(list(argv))
    return code, capsys.readouterr().err


# -- atomic writes ----------------------------------------------------------------------------------------------
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "entry.json"
    atomic_io.write_json(path, {"a": 1})
    with pytest.raises(RuntimeError):
        with atomic_io.atomic_path(path) as tmp:
            tmp.write_text('{"a": ')  # half written, then the writer fails
            raise RuntimeError("stopped mid-write")
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["entry.json"]
    img = Image.new("RGB", (4, 4), "red")
    images.save_image(img, tmp_path / "x.png")  # the format comes from the destination's suffix
    assert Image.open(tmp_path / "x.png").format == "PNG"
    with pytest.raises(ValueError, match="unknown image format"):
        images.save_image(img, tmp_path / "x.notanimage")


def test_a_write_the_destination_refuses_names_the_destination_not_the_temporary(tmp_path):
    (tmp_path / "grid.png").mkdir()  # a folder where the file goes
    with pytest.raises(IsADirectoryError) as e:
        atomic_io.write_json(tmp_path / "grid.png", {})
    assert e.value.filename == str(tmp_path / "grid.png") and os.listdir(tmp_path) == ["grid.png"]


def test_a_folder_is_swapped_in_whole(tmp_path):
    folder = tmp_path / "graph"
    for version in ("old", "new"):
        with atomic_io.atomic_folder(folder) as tmp:
            (tmp / "model.onnx").write_text(version)
            assert not (folder / "model.onnx").exists() or (folder / "model.onnx").read_text() == "old"
    assert (folder / "model.onnx").read_text() == "new" and os.listdir(tmp_path) == ["graph"]


def stopped_at_each_instruction(write, files=("atomic_io.py", "tempfile.py")):
    """Run write() again and again, raising KeyboardInterrupt (as a signal's handler does) before its n-th
    instruction in the named files, n = 1, 2, ...; yields after each stopped run, returns once a run completes."""
    for n in itertools.count(1):
        executed = 0

        def trace(frame, event, arg):
            nonlocal executed
            if os.path.basename(frame.f_code.co_filename) not in files:
                return None
            frame.f_trace_opcodes = True
            if event == "opcode":
                executed += 1
                if executed == n:
                    raise KeyboardInterrupt  # the trace is unset, the exception raised in the traced frame
            return trace
        sys.settrace(trace)
        try:
            write()
        except KeyboardInterrupt:
            yield n
            continue
        finally:
            sys.settrace(None)
        return


@pytest.mark.parametrize("kind", ["file", "folder", "probe"])
def test_a_write_stopped_at_any_instruction_leaves_the_old_or_the_new_and_no_temporary(tmp_path, kind):
    """A signal's exception comes between any two instructions: wherever it comes, the destination is whole
    (the old one or the new one) and no temporary is left (nor a probe file)."""
    destination = tmp_path / ("entry.json" if kind == "file" else "graph")

    def write(version: str) -> None:
        if kind == "file":
            atomic_io.write_text(destination, version)
        elif kind == "folder":
            with atomic_io.atomic_folder(destination) as tmp:
                (tmp / "model.onnx").write_text(version)
        else:
            atomic_io.check_writable(destination, "--out", folder=True)

    def content() -> str | None:
        path = destination / "model.onnx" if kind == "folder" else destination
        return path.read_text() if path.exists() else None
    write("old")
    stops = 0
    for _ in stopped_at_each_instruction(lambda: write("new")):
        stops += 1
        assert os.listdir(tmp_path) == ([] if kind == "probe" else [destination.name])
        assert content() in ({None} if kind == "probe" else {"old", "new"})
        if content() == "new":
            write("old")
    assert stops > 10 and content() == (None if kind == "probe" else "new")


def test_temporaries_of_dead_processes_and_old_ones_are_removed(tmp_path):
    dead = 2 ** 22 + 12345  # above Linux's pid_max default: no such process
    stale_file = tmp_path / f".a.png.lantern-{dead}-x1y2.tmp"
    stale_dir = tmp_path / f".verify-w5.lantern-{dead}-abcd.tmp"
    legacy = tmp_path / f".verify-w5-b1.tmp{dead}"  # an ONNX export folder of lantern 0.1.0
    live = tmp_path / f".b.png.lantern-{os.getpid()}-q.tmp"
    old_live = tmp_path / f".c.png.lantern-{os.getpid()}-r.tmp"
    for p in (stale_file, live, old_live):
        p.write_bytes(b"half")
    for d in (stale_dir, legacy):
        d.mkdir()
        (d / "model.onnx").write_bytes(b"x" * 10)
    day_ago = time.time() - atomic_io.STALE_AFTER_S - 1
    os.utime(old_live, (day_ago, day_ago))
    (tmp_path / "keep.png").write_bytes(b"a real output")
    removed = atomic_io.remove_stale(tmp_path)
    assert sorted(removed) == sorted([stale_file, stale_dir, legacy, old_live])
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, "keep.png"])


def test_names_the_filesystem_cannot_take_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--out: the name a+\.\.\. is 300 bytes; this filesystem allows 255"):
        atomic_io.check_fits(tmp_path / ("a" * 300) / "x.png", "--out")
    # a name that fits, but not with the temporary's prefix and suffix it is written under
    with pytest.raises(ValueError, match="as it writes it under a temporary name first"):
        atomic_io.check_fits(tmp_path / ("b" * 240 + ".png"), "--out")
    atomic_io.check_fits(tmp_path / ("c" * 100 + ".png"), "--out")


# -- cache entries ----------------------------------------------------------------------------------------------
CORRUPTIONS = {
    "not UTF-8": (b"\xff\xfe{", "is not UTF-8 text"),
    "not JSON": (b'{"key": ', "is not valid JSON"),
    "nested too deeply": (b"[" * 100_000, "is not valid JSON (nested too deeply to read)"),
    "not an object": (b"[1, 2]", "is malformed: must be a JSON object, got list"),
    "a folder": (None, "is a folder, not a file"),  # (None: a folder in the entry's place)
}


@pytest.mark.parametrize("kind", ["calibration", "records"])
@pytest.mark.parametrize("corruption", [*CORRUPTIONS, "wrong shape"])
def test_a_corrupt_cache_entry_is_named_moved_aside_and_measured_again(tmp_path, monkeypatch, capsys, kind,
                                                                        corruption):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    sampling = SamplingConfig()
    key = calibration.calibration_key("cpu", "fp32", "model", SamplingConfig(), 1024)
    if kind == "calibration":
        path, load = calibration.calibration_path(key), lambda: calibration.load_calibration(key)
        wrong = {"key": key, "widths": {"1": {"fixed_s": "fast", "plans": {}}}}
        empty = {"key": key, "widths": {}}
    else:
        path = records.record_path("model", sampling, "fp32")
        load = lambda: records.load_record("model", sampling, "fp32")  # noqa: E731
        wrong = {**records.empty_record("model", sampling, "fp32"), "plans": {"eagle2": {"steps": "many"}}}
        empty = records.empty_record("model", sampling, "fp32")
    data, message = (json.dumps(wrong).encode(), "is malformed") if corruption == "wrong shape" \
        else CORRUPTIONS[corruption]
    path.parent.mkdir(parents=True)
    if data is None:
        path.mkdir()
    else:
        path.write_bytes(data)
    assert load() == empty  # measured again, as if missing
    err = capsys.readouterr().err
    assert f"cache entry {path} {message}" in err and "measuring it again" in err
    aside = [p for p in path.parent.iterdir() if ".corrupt-" in p.name]
    assert not path.exists() and len(aside) == 1 and (aside[0].is_dir() if data is None
                                                      else aside[0].read_bytes() == data)


def test_a_folder_in_a_calibration_entrys_place_is_moved_aside_and_the_entry_stored(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    key = calibration.calibration_key("cpu", "fp32", "model", SamplingConfig(), 1024)
    path = calibration.calibration_path(key)
    path.mkdir(parents=True)
    calm = {"fixed_s": 0.01, "fixed_runs_s": [0.01, 0.011, 0.01], "ar_reference_s": [0.002, 0.0021, 0.0019],
            "plans": {"ar": {"step_s": 0.002, "ratio_to_ar": [1.0, 1.02, 0.98]}}}
    entry, _, why = calibration.cached_or_measured(key, 1, ["ar"], lambda entry: dict(calm))
    assert not why and calibration.load_calibration(key)["widths"]["1"] == calm and path.is_file()
    err = capsys.readouterr().err
    assert f"cache entry {path} is a folder, not a file" in err and ".tmp" not in err


def test_a_corrupt_onnx_manifest_is_rebuilt_not_fatal(tmp_path):
    from lantern.backends.onnx_export import MANIFEST, GRAPH, GraphKey, check_cached
    key = GraphKey("commit", 2, 1, 8, 1, "fp32", "0" * 64)
    folder = tmp_path / key.stem
    folder.mkdir()
    (folder / GRAPH).write_bytes(b"graph")
    (folder / MANIFEST).write_bytes(b"\xff\xfe")
    assert "is unreadable" in check_cached(key, tmp_path)


def test_unusable_cache_locations_are_named(tmp_path, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    monkeypatch.setenv(user_cache.CACHE_ENV, str(a_file))
    with pytest.raises(user_cache.CacheUnusable, match=f"cache folder {a_file} \\(from LANTERN_CACHE_DIR\\) is a "
                                                      f"file, not a folder"):
        user_cache.usable_root()
    if Path("/proc/self").exists():
        monkeypatch.setenv(user_cache.CACHE_ENV, "/proc/lantern-cache")  # not creatable, even by root (Linux)
        with pytest.raises(user_cache.CacheUnusable, match="/proc/lantern-cache \\(from LANTERN_CACHE_DIR\\) cannot be "
                                                          "used"):
            user_cache.usable_root()
    monkeypatch.delenv(user_cache.CACHE_ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(a_file / "home"))  # a service user's HOME that does not exist (nor can)
    with pytest.raises(user_cache.CacheUnusable, match=r"from HOME \(.*\)\) cannot be used: .*set LANTERN_CACHE_DIR"):
        user_cache.usable_root()
    from lantern.backends import onnx_export
    monkeypatch.setenv(onnx_export.CACHE_ENV, str(a_file))
    with pytest.raises(user_cache.CacheUnusable, match="from LANTERN_ONNX_CACHE"):
        onnx_export.usable_cache_dir()
    if os.geteuid() != 0:  # root writes into read-only folders
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        monkeypatch.setenv(user_cache.CACHE_ENV, str(ro))
        with pytest.raises(user_cache.CacheUnusable, match="cannot be used"):
            user_cache.usable_root()


def test_an_unusable_cache_fails_the_command_before_any_work(tmp_path, monkeypatch, capsys, bundle_dir):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    monkeypatch.setenv(user_cache.CACHE_ENV, str(a_file))
    code, err = run(capsys, "generate", "--model", str(bundle_dir), "--classes", "1", "--no-images")
    assert code == 2 and "LANTERN_CACHE_DIR" in err and str(a_file) in err
    assert "calibrating" not in err and "measuring" not in err and "Traceback" not in err
    monkeypatch.setenv(calibration.BUDGET_ENV, "soon")
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "cache"))
    code, err = run(capsys, "generate", "--model", str(bundle_dir), "--classes", "1", "--no-images")
    assert code == 2 and "LANTERN_CALIBRATION_BUDGET='soon' is not allowed" in err
    monkeypatch.delenv(calibration.BUDGET_ENV)
    monkeypatch.setenv("LANTERN_ONNX_CACHE", str(a_file))
    code, err = run(capsys, "generate", "--model", str(bundle_dir), "--classes", "1", "--no-images", "--method",
                    "ar", "--backend", "onnx")
    assert code == 2 and f"cache folder {a_file} (from LANTERN_ONNX_CACHE) is a file, not a folder\n" in err


# -- disturbed calibrations -------------------------------------------------------------------------------------
def test_a_disturbed_calibration_is_named_and_not_stored(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    calm = {"fixed_s": 0.01, "fixed_runs_s": [0.01, 0.011, 0.01], "ar_reference_s": [0.002, 0.0021, 0.0019],
            "plans": {"ar": {"step_s": 0.002, "ratio_to_ar": [1.0, 1.02, 0.98]}, "eagle2": {"step_s": 0.003}}}
    assert calibration.disturbance(calm) == ""
    assert calibration.disturbance({**calm, "ar_reference_s": [0.002, 0.0021, 0.09]}) == ""  # one late wake-up
    slowed = {**calm, "ar_reference_s": [0.002, 0.2, 0.21]}  # the other process ran through most of it
    assert "AR reference steps took 2 ms at the fastest and 200 ms at the median" in calibration.disturbance(slowed)
    self_ratio = {**calm, "plans": {**calm["plans"], "ar": {"step_s": 0.2, "ratio_to_ar": [100.0, 90.0]}}}
    assert "AR timed at 95.00x its own reference run" in calibration.disturbance(self_ratio)
    zero = {**calm, "plans": {**calm["plans"], "eagle2": {"step_s": 0.0}}}
    assert "eagle2 timed no slower than the fixed cost alone" in calibration.disturbance(zero)
    key = calibration.calibration_key("cpu", "fp32", "model", SamplingConfig(), 1024)
    entry, _, why = calibration.cached_or_measured(key, 1, ["ar"], lambda entry: dict(slowed))
    assert why and entry["plans"]["ar"]["step_s"] == 0.002 and not calibration.calibration_path(key).exists()
    assert "calibration disturbed" in capsys.readouterr().err
    entry, _, why = calibration.cached_or_measured(key, 1, ["ar"], lambda entry: dict(calm))
    assert not why and calibration.load_calibration(key)["widths"]["1"] == calm


def test_a_calibration_made_ahead_of_time_is_measured_again_while_disturbed(tmp_path, monkeypatch, capsys):
    """`lantern profile calibrate` (tries > 1): a disturbed measurement is taken again from the same cached entry,
    and the first calm one is stored; a request (one try) keeps AR instead, as above."""
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    calm = {"fixed_s": 0.01, "fixed_runs_s": [0.01, 0.011, 0.01], "ar_reference_s": [0.002, 0.0021, 0.0019],
            "plans": {"ar": {"step_s": 0.002, "ratio_to_ar": [1.0, 1.02, 0.98]}}}
    slowed = {**calm, "ar_reference_s": [0.002, 0.2, 0.21]}
    given, results = [], [slowed, calm]

    def measure(entry):
        given.append(entry)
        return dict(results[len(given) - 1])
    key = calibration.calibration_key("cpu", "fp32", "model", SamplingConfig(), 1024)
    entry, _, why = calibration.cached_or_measured(key, 1, ["ar"], measure, tries=calibration.AHEAD_TRIES)
    assert not why and given == [None, None] and calibration.load_calibration(key)["widths"]["1"] == calm
    assert f"measuring it again (try 2 of {calibration.AHEAD_TRIES})" in capsys.readouterr().err
    key = calibration.calibration_key("cpu", "fp32", "another model", SamplingConfig(), 1024)
    entry, _, why = calibration.cached_or_measured(key, 1, ["ar"], lambda entry: dict(slowed), tries=2)
    assert why and not calibration.calibration_path(key).exists()
    assert "try 2 of 2" in capsys.readouterr().err


# -- refusals before any work -----------------------------------------------------------------------------------
def test_late_refusals_now_come_first_and_name_their_cause(tmp_path, capsys, bundle_dir):
    model = ["--model", str(bundle_dir), "--method", "ar"]
    out = tmp_path / "out"
    code, err = run(capsys, "generate", *model, "--seed", str(2 ** 64), "--out", str(out))
    assert code == 2 and f"argument --seed: {2 ** 64} is not allowed; allowed: an integer in [0, " \
                          f"{2 ** 63 - 1}]" in err  # the engine's seeds (lantern.engine.seeds.SEED_RANGE)
    code, err = run(capsys, "generate", *model, "--classes", "1", "--out", str(tmp_path / ("a" * 300)))
    assert code == 2 and "--out: the name" in err and "this filesystem allows 255" in err
    code, err = run(capsys, "generate", *model, "--classes", "1", "--scale", "1000000", "--out", str(out))
    assert code == 2 and "--scale 1000000 makes a grid of" in err and "allowed: --scale <=" in err
    code, err = run(capsys, "eval", *model, "--classes", "1", "--n-per-class", "1")
    assert code == 2 and "no evaluator.safetensors" in err and "eval:" not in err  # before the progress bar
    code, err = run(capsys, "eval", "--method", "ar", "--classes", "1", "--n-per-class", "1")  # the embedded model
    assert code == 2 and "eval needs at least 2 images" in err and "--n-per-class" in err
    code, err = run(capsys, "eval", "--method", "ar", "--classes", "1", "--n-per-class", "60", "--seed",
                    str(2 ** 63 - 1))
    assert code == 2 and f"eval seeds its chunks {2 ** 63 - 1}..{2 ** 63}" in err and f"{2 ** 63 - 2}]" in err
    assert not out.exists()


SEED_MAX = 2 ** 63 - 1


@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1])
def test_a_seed_out_of_range_is_refused_alike_by_the_cli_the_library_and_the_service(tmp_path, capsys, bundle_dir,
                                                                                    tiny, seed):
    """One range, [0, 2^63 - 1], and one refusal naming the value and the range: `--seed`, Pipeline.generate and
    the service's `seed` field (docs/reliability.md)."""
    from lantern.api import Pipeline
    from lantern.serve.schema import ModelInfo, RequestError, parse_request
    refusal = f"{seed} is not allowed; allowed: an integer in [0, {SEED_MAX}]"
    code, err = run(capsys, "generate", "--model", str(bundle_dir), "--method", "ar", "--classes", "1",
                    "--no-images", "--seed", str(seed))
    assert code == 2 and f"argument --seed: {refusal}" in err
    with pytest.raises(ValueError) as library:
        Pipeline(tiny[0], backend="cpu").generate([1], _ar(), seed=seed)
    info = ModelInfo(name="m", model_type="c2i", num_classes=4, image_size=8, methods=("auto",), max_n=1,
                     max_timeout_s=1.0)
    with pytest.raises(RequestError) as service:
        parse_request({"class_id": 1, "seed": seed}, info, 1.0)
    assert str(library.value) == str(service.value) == f"seed {refusal}" and service.value.field == "seed"


def test_the_largest_seed_is_taken_by_the_cli_the_library_and_the_service(capsys, bundle_dir, tiny):
    from lantern.api import Pipeline
    from lantern.serve.schema import ModelInfo, parse_request
    code, err = run(capsys, "generate", "--model", str(bundle_dir), "--method", "ar", "--classes", "1",
                    "--no-images", "--seed", str(SEED_MAX))
    assert code == 0, err
    assert Pipeline(tiny[0], backend="cpu").generate([1], _ar(), seed=SEED_MAX).seed == SEED_MAX
    info = ModelInfo(name="m", model_type="c2i", num_classes=4, image_size=8, methods=("auto",), max_n=1,
                     max_timeout_s=1.0)
    assert parse_request({"class_id": 1, "seed": SEED_MAX}, info, 1.0).seed == SEED_MAX


def test_memory_that_cannot_be_allocated_names_the_flag(tmp_path, capsys, bundle_dir, monkeypatch):
    from lantern.api import Pipeline

    def too_big(self, dcfg, batch):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)")
    monkeypatch.setattr(Pipeline, "runner", too_big)
    code, err = run(capsys, "generate", "--model", str(bundle_dir), "--method", "ar", "--no-images")
    assert code == 2 and "not enough memory for this request" in err and "lower --batch" in err
    assert "Traceback" not in err


def test_auto_that_cannot_fit_exits_2_before_building_or_timing_anything(capsys, bundle_dir, monkeypatch):
    """The default, --method auto, at 64 images per step with memory for AR at 16: refused (exit 2) before any
    runner is built or anything timed, naming auto's smallest plan and the widest --batch where it fits; it used
    to prepare and time runners at that width first (issue 56: 4096 images grew to 24 GB)."""
    import lantern.api
    from lantern.api import Pipeline
    from lantern.bundle import load_bundle
    from lantern.decoding.config import method_preset
    pipe = Pipeline.from_bundle(load_bundle(bundle_dir), backend="cpu")
    available = pipe.predict_peak(method_preset("ar", pipe.defaults.sampling), 16).total_bytes
    monkeypatch.setattr(lantern.api, "available_bytes", lambda device: (available, "a test's figure"))

    def built(self, *args):
        raise AssertionError("a runner was built")
    monkeypatch.setattr(Pipeline, "runner", built)
    code, err = run(capsys, "generate", "--model", str(bundle_dir), "--backend", "cpu", "--classes", *["0"] * 64,
                    "--batch", "64", "--no-images")
    assert code == 2, err
    assert "--method auto at 64 image(s) per step (AR, its smallest plan) cannot fit" in err, err
    assert "it would fit with --batch 16 (batch=16)" in err and "Traceback" not in err


def write_config(bundle_dir: Path, tmp_path: Path, edit) -> Path:
    import shutil
    copy = tmp_path / "bundle"
    shutil.copytree(bundle_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    from lantern.bundle import sha256_file
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["config.json"] = sha256_file(copy / "config.json")  # so the edit is read, not refused
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["target"].update(dim="wide"), "field 'target' is malformed"),
    (lambda c: c.pop("vq"), "field 'vq' is missing or not an object"),
    (lambda c: c.update(sampling=[1]), "field 'sampling' must be an object"),
])
def test_a_malformed_bundle_config_names_file_and_field(tmp_path, capsys, bundle_dir, edit, message):
    copy = write_config(bundle_dir, tmp_path, edit)
    code, err = run(capsys, "generate", "--model", str(copy), "--method", "ar", "--no-images")
    assert code == 2 and f"{copy / 'config.json'}: {message}" in err and "Traceback" not in err


def test_a_malformed_manifest_is_named(tmp_path, capsys, bundle_dir):
    copy = write_config(bundle_dir, tmp_path, lambda c: None)
    (copy / "manifest.json").write_text("{not json")
    code, err = run(capsys, "generate", "--model", str(copy), "--method", "ar", "--no-images")
    assert code == 2 and f"{copy / 'manifest.json'} is not valid JSON" in err


def test_unloadable_checkpoints_are_named_and_the_pickle_is_never_run(tmp_path, capsys):
    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))
    pickled = tmp_path / "pickled.pt"
    torch.save({"model": {"w": torch.zeros(1)}, "extra": Payload()}, pickled)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    out = tmp_path / "graphs"
    for path, message in [(pickled, "holds Python objects besides tensors"),
                          (garbage, "is not a readable PyTorch checkpoint"),
                          (broken, "is not a readable safetensors file")]:
        code, err = run(capsys, "export-onnx", "--preset", "GPT-test", "--checkpoint", str(path), "--method", "ar",
                        "--cfg-scale", "1",
                        "--out", str(out))
        assert code == 2 and f"checkpoint {path} {message}" in err, err
        assert "weights_only" not in err and "Traceback" not in err
    assert not (tmp_path / "ran").exists()  # the pickle's payload never ran


def test_python_api_takes_numpy_and_torch_class_ids_and_refuses_plan_0(tiny):
    from lantern.api import Pipeline, check_classes
    assert check_classes([np.int64(1), torch.tensor(2), np.int32(0), 3], 4) == [1, 2, 0, 3]
    for bad, message in [(1.0, "not an integer"), (torch.tensor([1, 2]), "not an integer"), (np.int64(9), "out of range")]:
        with pytest.raises(ValueError, match=message):
            check_classes([bad], 4)
    target, drafter, proximity = tiny
    pipe = Pipeline(target, drafter, proximity, backend="cpu")
    result = pipe.generate(torch.tensor([1, 2]), _ar(), batch=2)
    assert result.conditions == [1, 2]
    for n in (0, -1, 1.5):
        with pytest.raises(ValueError, match=f"n_images {n!r} is not allowed; allowed: an integer >= 1"):
            pipe.plan(n, SamplingConfig())


def _ar():
    from lantern.decoding.config import method_preset
    return method_preset("ar", SamplingConfig())


@pytest.mark.parametrize("line, message", [
    ('threads = "many"', "threads must be an integer, got 'many'"),
    ("batch_sizes = 4", "batch_sizes must be an array, got 4"),
    ("repeats = 2.5", "repeats must be an integer, got 2.5"),
    ("dtype = 3", "dtype must be a string, got 3"),
])
def test_a_profile_value_of_the_wrong_type_names_file_and_key(tmp_path, capsys, line, message):
    profile = tmp_path / "mine.toml"
    profile.write_text(f'name = "mine"\n{line}\n')
    code, err = run(capsys, "generate", "--profile", str(profile), "--method", "ar", "--no-images")
    assert code == 2 and f"{profile}: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("content, problem", [
    (b'name = "mine"\n\xff\n', "is not UTF-8 text (byte 0xff at offset 14)"),
    (b"name = ", "is not valid TOML (Invalid value (at end of document))"),
])
def test_an_unreadable_profile_file_is_refused_naming_it(tmp_path, capsys, content, problem):
    profile = tmp_path / "mine.toml"
    profile.write_bytes(content)
    for argv in (["generate", "--profile", str(profile), "--method", "ar", "--no-images"],
                 ["profile", "run", "--profile", str(profile), "--out", str(tmp_path / "results.json")]):
        code, err = run(capsys, *argv)
        assert code == 2 and f"profile {profile} {problem}" in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "results.json").exists()


UNREADABLE_JSON = [
    (b"\xff{}", "is not UTF-8 text (byte 0xff at offset 0)"),
    (b"{not", "is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    (b"[" * 100_000, "is not valid JSON (nested too deeply to read)"),
    (None, "is a folder, not a file"),  # (None: a folder where the file should be)
]


def unreadable(path: Path, content: bytes | None) -> Path:
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    return path


@pytest.mark.parametrize("content, problem", UNREADABLE_JSON)
def test_an_unreadable_results_file_is_refused_naming_it(tmp_path, capsys, content, problem):
    results = unreadable(tmp_path / "results.json", content)
    code, err = run(capsys, "profile", "compare", str(results), "--out", str(tmp_path / "report"))
    assert code == 2 and f"results file {results} {problem}" in err and "Traceback" not in err, err
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("content, problem", UNREADABLE_JSON)
def test_an_unreadable_tree_file_is_refused_naming_it(tmp_path, capsys, content, problem):
    tree = unreadable(tmp_path / "tree.json", content)
    code, err = run(capsys, "generate", "--method", "eagle2", "--drafting", str(tree), "--classes", "1",
                    "--no-images")
    assert code == 2 and f"tree file {tree} {problem}" in err and "Traceback" not in err, err


def test_a_results_file_missing_a_field_names_file_case_and_field(tmp_path, capsys):
    from lantern.profile.schema import SCHEMA, SCHEMA_VERSION, SchemaError, load_results
    case = {"kind": "verify", "status": "ok", "params": {"batch": 1, "N": 1}, "result": {"latency": {}}}
    data = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "profile": {}, "backend": {}, "model": {},
            "environment": {}, "started_at": "", "updated_at": "", "complete": True, "cases": {"verify/b1/N1": case}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=f"{path}: ok case 'verify/b1/N1' has no result field 'memory'"):
        load_results(path)
    code, err = run(capsys, "profile", "compare", str(path), "--out", str(tmp_path / "report"))
    assert code == 2 and "has no result field 'memory'" in err and "Traceback" not in err


@pytest.mark.usefixtures("unlimited_deciding")
def test_a_run_whose_calibration_was_disturbed_keeps_ar(tiny, tmp_path, monkeypatch):
    """A timing that makes MC-SJD look 100x cheaper than AR, with its AR references 50x apart: auto keeps AR, says
    why, and stores nothing."""
    from lantern.api import Pipeline
    from lantern.decoding.sampling import SamplingConfig
    from lantern.plan.choose import choose
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path))
    pipe = Pipeline(tiny[0], backend="cpu")  # no drafter: the Jacobi plans, the fewest to record

    def disturbed(pipe, plans, sampling, width, per_chunk, entry=None, progress=True, attended=None, **rounds):
        return {"fixed_s": 0.01, "ar_reference_s": [0.001, 0.05, 0.05], "seconds": 1.0, "prepare_s": 0.0,
                "plans": {p.name: {"step_s": 0.001 if p.name == "ar" else 1e-5} for p in plans}}
    monkeypatch.setattr(calibration, "measure_width", disturbed)
    choice = choose(pipe, 1, SamplingConfig(top_k=5), progress=False)
    assert choice.plan.name == "ar" and "calibration disturbed (its AR reference steps" in choice.cost_source
    # no width's timing is stored (the file keeps AR's quick estimate, what deciding was sized by, and nothing else)
    key = calibration.pipe_key(pipe, SamplingConfig(top_k=5))
    assert calibration.load_calibration(key)["widths"] == {}


# -- model-family folders: weights that all come from the files, or a refusal naming the file ---------------------
@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    """A tiny Janus and a tiny Chameleon folder (with its VQGAN), built once; tests damage copies."""
    pytest.importorskip("transformers")
    from chameleon_fixtures import make_chameleon_folder
    from janus_fixtures import make_janus_folder
    root = tmp_path_factory.mktemp("families")
    make_janus_folder(root / "janus")
    make_chameleon_folder(root / "chameleon")
    return root


def damaged(family_folders, tmp_path, family: str, edit) -> Path:
    import shutil
    folder = tmp_path / family
    shutil.copytree(family_folders / family, folder)
    edit(folder)
    return folder


def generate_family(capsys, folder: Path, tmp_path: Path, *extra: str) -> tuple[int, str]:
    out = tmp_path / "out"
    code, err = run(capsys, "generate", "--model", str(folder), "--prompt", "a red cat", "--method", "ar",
                    "--out", str(out), *extra)
    assert not out.exists(), "a refused folder wrote images"
    return code, err


def without(*prefixes: str):
    """Edit: drop every tensor whose name starts with one of `prefixes` from model.safetensors."""
    def edit(folder: Path) -> None:
        from safetensors.torch import load_file, save_file
        state = load_file(str(folder / "model.safetensors"))
        save_file({k: v for k, v in state.items() if not k.startswith(prefixes)}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
    return edit


def with_config(family: str, **fields):
    """Edit: set `fields` in config.json (Janus: in its text_config, where the language model's sizes live)."""
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (config["text_config"] if family == "janus" else config).update(fields)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


@pytest.mark.parametrize("family, prefixes, names", [
    ("janus", ("model.generation_head.proj_out.",), "2 tensors missing ['model.generation_head.proj_out.bias', "
                                                   "'model.generation_head.proj_out.weight']"),
    ("janus", ("model.language_model.layers.1.self_attn.q_proj.",),
     "1 tensors missing ['model.language_model.layers.1.self_attn.q_proj.weight']"),
    ("chameleon", ("model.layers.1.self_attn.q_proj.",),
     "1 tensors missing ['model.layers.1.self_attn.q_proj.weight']"),
    ("chameleon", ("model.layers.1.",), "13 tensors missing ['model.layers.1.input_layernorm.weight'"),
])
def test_a_family_folder_missing_a_tensor_never_runs_on_random_weights(family_folders, tmp_path, capsys, family,
                                                                       prefixes, names):
    folder = damaged(family_folders, tmp_path, family, without(*prefixes))
    code, err = generate_family(capsys, folder, tmp_path)
    assert code == 2 and f"{folder}: weights model.safetensors do not hold the model its config.json describes" in err
    assert names in err and "Traceback" not in err
    if family == "chameleon" and prefixes == ("model.layers.1.",):
        assert "(+7 more)" in err  # a long list is cut to its first keys and a count


def test_a_refused_family_folder_prints_lanterns_refusal_alone(family_folders, tmp_path):
    """transformers' own load report (its table of MISSING keys, "newly initialized") is held back while lantern
    loads a folder, which names the keys itself: stderr is its loading bar (progress), then lantern's one-line
    refusal. In a process of its own, as a user runs it (transformers' log handler keeps the stderr it was
    created with)."""
    import subprocess
    folder = damaged(family_folders, tmp_path, "janus", without("model.generation_head.proj_out."))
    proc = subprocess.run([sys.executable, "-m", "lantern.cli", "generate", "--model", str(folder), "--prompt",
                           "a red cat", "--method", "ar", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "LOAD REPORT" not in proc.stderr and "newly initialized" not in proc.stderr
    *bar, refusal = proc.stderr.rstrip("\n").split("\n")
    assert all(line.strip() == "" or line.lstrip("\r").startswith("Loading weights") for line in bar), bar
    assert [refusal] == [f"lantern: error: {folder}: weights model.safetensors do not hold the model "
                                        f"its config.json describes (part of it would run on random weights): 2 "
                                        f"tensors missing ['model.generation_head.proj_out.bias', "
                                        f"'model.generation_head.proj_out.weight']"], proc.stderr


def test_transformers_output_is_held_back_only_while_lantern_loads(family_folders, tmp_path):
    from transformers import JanusConfig, JanusForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from lantern.models.folders import load_pretrained, read_config
    folder = damaged(family_folders, tmp_path, "janus", without("model.generation_head.proj_out."))
    hf_logging.set_verbosity_info()
    try:
        with pytest.raises(ValueError, match="2 tensors missing"):
            load_pretrained(JanusForConditionalGeneration, folder, read_config(JanusConfig, folder))
        assert hf_logging.get_verbosity() == hf_logging.INFO
    finally:
        hf_logging.set_verbosity_warning()


def truncated(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])


def safetensors_header(header: bytes, declared: int | None = None):
    """Edit: model.safetensors replaced by an 8-byte length (`declared`, else the header's own) then `header`."""
    def edit(folder: Path) -> None:
        length = len(header) if declared is None else declared
        (folder / "model.safetensors").write_bytes(length.to_bytes(8, "little") + header)
    return edit


def wrong_shape(folder: Path) -> None:
    from safetensors.torch import load_file, save_file
    state = load_file(str(folder / "model.safetensors"))
    state["model.generation_head.proj_out.weight"] = torch.zeros(3, 3)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("family, edit, names", [
    ("janus", truncated, "model.safetensors (5000 bytes) is not a readable safetensors file"),
    ("chameleon", truncated, "model.safetensors (5000 bytes) is not a readable safetensors file"),
    ("janus", lambda f: (f / "model.safetensors").write_bytes(b""),
     "model.safetensors (0 bytes) is not a readable safetensors file"),
    ("janus", lambda f: (f / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096)),
     "model.safetensors (4096 bytes) is not a readable safetensors file"),
    ("janus", safetensors_header(b"{}", declared=10 ** 15), "header too large"),
    ("janus", safetensors_header(b"x" * 20 + b"\0" * 100, declared=20), "invalid JSON in header"),
    ("janus", lambda f: (f / "model.safetensors").unlink(), "has no weights: expected model.safetensors or "),
    ("janus", wrong_shape, "1 tensors of another shape than config.json gives "
                           "['model.generation_head.proj_out.weight: file (3, 3) vs config (64, 64)']"),
    ("janus", with_config("janus", hidden_size=128), "20 tensors of another shape than config.json gives"),
    ("chameleon", with_config("chameleon", hidden_size=128), "29 tensors of another shape than config.json gives"),
    ("janus", with_config("janus", num_hidden_layers="two"),
     "config.json is not a usable JanusConfig: Validation error for field 'num_hidden_layers'"),
    ("chameleon", with_config("chameleon", num_hidden_layers="two"),
     "config.json is not a usable ChameleonConfig: Validation error for field 'num_hidden_layers'"),
])
def test_unloadable_family_weights_exit_2_naming_the_file(family_folders, tmp_path, capsys, family, edit, names):
    folder = damaged(family_folders, tmp_path, family, edit)
    code, err = generate_family(capsys, folder, tmp_path)
    assert code == 2 and str(folder) in err and names in err, err
    assert "Traceback" not in err and "internal error" not in err


@pytest.mark.parametrize("edit, names", [
    (lambda f: (f / "tokenizer" / "vqgan.ckpt").write_bytes(b"PK\x03\x04 truncated"),
     "VQGAN checkpoint {f}/tokenizer/vqgan.ckpt is not a readable PyTorch checkpoint"),
    (lambda f: torch.save({"state_dict": {"quantize.embedding.weight": torch.zeros(3, 3)}},
                          f / "tokenizer" / "vqgan.ckpt"), "VQGAN checkpoint {f}/tokenizer/vqgan.ckpt does not match"),
])
def test_an_unreadable_chameleon_vqgan_is_refused_before_generating(family_folders, tmp_path, capsys, monkeypatch,
                                                                    edit, names):
    from lantern.api import Pipeline
    monkeypatch.setattr(Pipeline, "generate", lambda *a, **k: pytest.fail("generation started"))
    folder = damaged(family_folders, tmp_path, "chameleon", edit)
    code, err = generate_family(capsys, folder, tmp_path)
    assert code == 2 and names.format(f=folder) in err and "Traceback" not in err


def test_a_code_carrying_pickle_is_refused_without_torchs_advice(family_folders, tmp_path, capsys):
    """Chameleon's vqgan.ckpt, a Janus folder's pytorch_model.bin and LlamaGen's --gpt / --vq in `lantern import`:
    refused, the payload never runs, and the refusal does not pass on torch's advice to load with
    weights_only=False."""
    from test_llamagen_import import import_argv, llamagen_gpt_file, llamagen_vq_file

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))
    folder = damaged(family_folders, tmp_path, "chameleon",
                     lambda f: torch.save({"state_dict": {}, "callback": Payload()}, f / "tokenizer" / "vqgan.ckpt"))
    code, err = generate_family(capsys, folder, tmp_path)
    assert code == 2 and f"VQGAN checkpoint {folder}/tokenizer/vqgan.ckpt holds Python objects besides tensors" in err
    assert "weights_only" not in err and "Re-running" not in err

    def as_pickled_bin(f: Path) -> None:  # a transformers folder's pytorch_model.bin carrying the payload
        from safetensors.torch import load_file
        state = load_file(str(f / "model.safetensors"))
        (f / "model.safetensors").unlink()
        torch.save({**state, "callback": Payload()}, f / "pytorch_model.bin")
    folder = damaged(family_folders, tmp_path, "janus", as_pickled_bin)
    code, err = generate_family(capsys, folder, tmp_path)
    assert code == 2 and f"{folder}: weights pytorch_model.bin cannot be loaded: it holds Python objects" in err
    assert "weights_only" not in err and "Re-running" not in err
    llamagen_gpt_file(tmp_path / "gpt.pt", "c2i")
    llamagen_vq_file(tmp_path / "vq.pt")
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "args": Payload()}, evil)
    for gpt, vq, what in [(evil, tmp_path / "vq.pt", "GPT checkpoint"), (tmp_path / "gpt.pt", evil, "VQ checkpoint")]:
        code, err = run(capsys, *import_argv(gpt, vq, tmp_path / "bundle"))
        assert code == 2 and f"{what} {evil} holds Python objects besides tensors" in err, err
        assert "weights_only" not in err and "Re-running" not in err and not (tmp_path / "bundle").exists()
    assert not (tmp_path / "ran").exists()  # no payload ran


@pytest.mark.parametrize("edit, names", [
    (lambda f: (f / "config.json").unlink(), "{f}: config.json is missing"),
    (lambda f: (f / "config.json").write_text("{not json"), "{f}/config.json is not valid JSON"),
    (lambda f: (f / "config.json").write_text("[" * 100_000), "{f}/config.json is not valid JSON (nested too deeply"),
    (lambda f: (f / "config.json").write_text("{}"), "{f}: model_type None"),
])
def test_a_family_folder_with_a_broken_config_is_named_not_taken_for_a_bundle(family_folders, tmp_path, capsys,
                                                                              edit, names):
    folder = damaged(family_folders, tmp_path, "janus", edit)
    code, err = generate_family(capsys, folder, tmp_path)
    assert code == 2 and names.format(f=folder) in err and "T5" not in err and "internal error" not in err, err


def test_an_image_size_the_gpt_was_not_trained_for_is_refused(tmp_path, capsys):
    from test_llamagen_import import import_argv, llamagen_gpt_file, llamagen_vq_file
    llamagen_gpt_file(tmp_path / "gpt.pt", "c2i")  # 4x4 tokens through a VQ that halves the side: 8 px
    llamagen_vq_file(tmp_path / "vq.pt")
    argv = import_argv(tmp_path / "gpt.pt", tmp_path / "vq.pt", tmp_path / "bundle")
    argv[argv.index("--image-size") + 1] = "512"
    code, err = run(capsys, *argv)
    assert code == 2 and "--image-size 512: the VQ makes a 256x256 grid of 65536 tokens, but GPT checkpoint" in err
    assert "was trained for 16 image tokens" in err and "give --image-size 8" in err
    assert not (tmp_path / "bundle").exists()


def test_messages_name_the_file_and_the_tensor(tmp_path, capsys, bundle_dir):
    """A GPT whose width gives a head size 2D RoPE cannot take, a folder given for --gpt, and `lantern info` of a
    bundle whose config.json is not UTF-8, not JSON, or lacks its target: each names the file (and the tensor)."""
    import shutil

    from lantern.models.config import GPTConfig
    from lantern.models.gpt import GPT
    from test_llamagen_import import SMALL, import_argv, llamagen_vq_file
    llamagen_vq_file(tmp_path / "vq.pt")
    state = GPT(GPTConfig(**SMALL, num_classes=4)).state_dict()
    wide = {k: torch.zeros([72 if n == 64 else n for n in v.shape]) for k, v in state.items()}  # 4 heads of 18
    torch.save({"model": wide}, tmp_path / "odd.pt")
    code, err = run(capsys, *import_argv(tmp_path / "odd.pt", tmp_path / "vq.pt", tmp_path / "b"))
    assert code == 2 and f"GPT checkpoint {tmp_path / 'odd.pt'}: head_dim 18 must be a multiple of 4" in err
    assert "tok_embeddings.weight" in err
    code, err = run(capsys, *import_argv(tmp_path, tmp_path / "vq.pt", tmp_path / "b"))
    assert code == 2 and f"GPT checkpoint {tmp_path} is a folder; give the checkpoint file" in err
    for content, message in [(b"\xff\xfe{}", "config.json is not UTF-8 text"),
                             (b"{not json", "config.json is not valid JSON"),
                             (b"{}", "config.json: field 'target' is missing or not an object")]:
        copy = tmp_path / "bundle"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(bundle_dir, copy)
        (copy / "config.json").write_bytes(content)
        code, err = run(capsys, "info", "--model", str(copy))
        assert code == 2 and f"{copy}/{message}" in err and "internal error" not in err, err


@pytest.mark.parametrize("flag, value", [("--threads", "0"), ("--steps", "0"), ("--lr", "nan")])
def test_a_training_flag_out_of_range_is_named_before_any_work(tmp_path, capsys, flag, value):
    """`lantern train evaluator --threads 0` ended in torch's traceback; every numeric flag is checked first."""
    from lantern.cli import main
    assert main(["train", "evaluator", "--work", str(tmp_path / "w"), flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}" in err and "Traceback" not in err
    assert not (tmp_path / "w").exists()
