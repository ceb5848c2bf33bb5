"""tools/gpu_check.py --quick: the GPU check's own code, end to end on CPU stand-ins and tiny shapes, so that a
typo cannot waste a GPU lease. The tiny bundle keeps the service section short."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_bundle import write_tiny_bundle

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.py"


def run_tool(*args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
def test_quick_runs_every_section_on_labelled_stand_ins(tmp_path):
    bundle = write_tiny_bundle(tmp_path / "bundle")
    device_out = tmp_path / "device-out"
    device_out.mkdir()
    done = run_tool("--quick", "--model", str(bundle), "--out", str(tmp_path / "gpu-quick"), out=device_out)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "gpu-quick.json").read_text())
    sections = record["sections"]
    assert set(sections) == {"env", "conformance", "parity", "sync", "cold", "distribution", "timing", "serve"}
    assert not record.get("errors") and not any("error" in v for v in sections.values() if isinstance(v, dict))
    assert record["skipped"] == [] and record["budget_s"] is None  # no budget: nothing is skipped however busy
    assert record["quick"] and record["stand_ins"] == {"eager": "cpu", "graph": "cpu-graph", "fused": "cpu-graph"}
    assert "stand-in" in sections["env"]["device"]
    assert all(r["passed"] for r in sections["conformance"].values())
    parity = sections["parity"]["methods"]
    assert set(parity) == {"ar", "mc-sjd", "lantern++", "mc-sjd-relaxed", "eagle2", "lantern", "sjd", "mc-sjd-pac"}
    assert all(v["equal"] for by_mode in parity.values() for v in by_mode.values())
    assert set(parity["lantern++"]) == {"eager", "fused", "graph"}
    sync = sections["sync"]  # --quick: 2 images of 6 tokens; the prefill's forward runs inside the first step
    assert sync["ar"]["steps"] == 6  # AR: a token per target forward
    for r in sync.values():  # one host read per engine step, none more inside it
        assert sum(n for site, n in r["sites"].items() if site.endswith("(step)")) == r["steps"] - 1, r
        assert sum(r["sites"].values()) == r["syncs"] and r["beyond_one_per_step"] == r["syncs"] - r["steps"]
    cold = sections["cold"]["runs"]  # new processes: with empty compile caches, again with warm ones, the default
    assert list(cold) == ["cold_machine", "warm_caches", "default"]
    assert all(r["exit_code"] == 0 and 0 < r["first_image_s"] <= r["wall_s"] for r in cold.values())
    assert cold["warm_caches"]["backend"] == "cpu-graph" and cold["default"]["plan"]["plan"]
    assert ("cold tiny --backend cpu-graph --fused-step --method ar --dtype bf16, empty caches: first image "
            in done.stdout)
    assert sections["distribution"]["passed"] and set(sections["distribution"]["methods"]) == {"mc-sjd", "mc-sjd-pac"}
    rows = sections["timing"]["rows"]
    methods = ("ar", "mc-sjd", "mc-sjd-pac", "mc-sjd-pac:fan=60:window=48:branch_depth=3", "mc-sjd-relaxed", "eagle2",
               "lantern", "lantern++")
    assert {(r["sampling"], r["method"]) for r in rows} >= {(s, m) for s in ("bundle", "llamagen-c2i") for m in methods}
    assert {r["mode"] for r in rows if r["method"] == "ar"} == {"eager", "graph", "fused"}
    assert any(r["mode"] == "auto" for r in rows)
    assert all(r.get("fastest_ar") for r in rows)
    assert all(r["tokens_per_forward"] == 1.0 for r in rows if r["method"] == "ar")
    for r in rows:  # 6 tokens over a whole number of forwards: the prefill's and at least one step's
        forwards = 6 / r["tokens_per_forward"]
        assert abs(forwards - round(forwards)) < 1e-9 and 2 <= round(forwards) <= 6, r
    assert {r["ratio_timed"] for r in rows if "ratio_timed" in r} == {"eager"}  # no CUDA graph to replay here
    serve = sections["serve"]
    for run in (serve["service"], serve["one_process_per_image"]):
        assert run["images"] > 0 and run["images_per_s"] == pytest.approx(run["images"] / run["seconds"])
    assert serve["service_over_processes"] == pytest.approx(
        serve["service"]["images_per_s"] / serve["one_process_per_image"]["images_per_s"])
    for suffix in (".json", ".md", ".png"):  # written, and copied under $OUT for the device tool
        assert (tmp_path / f"gpu-quick{suffix}").exists() and (device_out / f"gpu-quick{suffix}").exists()
    assert "stand-ins" in (tmp_path / "gpu-quick.md").read_text()
    assert done.stdout.splitlines()[-1].startswith("[gpu_check] results:")
    assert "greedy parity lantern++: eager =, fused =, graph =" in done.stdout
    again = run_tool("--quick", "--model", str(bundle), "--out", str(tmp_path / "gpu-quick"), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    kept = json.loads((tmp_path / "gpu-quick.json").read_text())
    assert kept["sections"]["timing"]["rows"] == rows and kept["sections"]["serve"] == sections["serve"]
    assert kept["sections"]["cold"] == sections["cold"]
    assert "timing tiny llamagen-c2i B=1: kept from commit" in again.stderr and len(kept["earlier_runs"]) == 1


def gpu_check_module():
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    return gpu_check


@pytest.mark.parametrize("args, message", [
    (["--budget-s", "0"], "--budget-s 0.0 is not allowed; allowed: a finite number of seconds > 0"),
    (["--budget-s", "nan"], "--budget-s nan is not allowed; allowed: a finite number of seconds > 0"),
    (["--serve-s", "inf"], "--serve-s inf is not allowed; allowed: a finite number of seconds > 0"),
    (["--images", "1", "0"], "--images 0 is not allowed; allowed: an integer >= 1"),
    (["--sync-tokens", "-3"], "--sync-tokens -3 is not allowed; allowed: an integer >= 1"),
    (["--model", "no-such-bundle"], "--model no-such-bundle is not allowed (no-such-bundle is not a lantern bundle: "
                                    "config.json is missing); allowed: a lantern bundle folder"),
    (["--out", ""], "--out '' is not allowed; allowed: a file stem such as results/gpu-run"),
])
def test_bad_options_exit_2_naming_the_value(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check_module().parse_args(["--quick", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_every_input_is_refused_before_any_section_runs_all_at_once(tmp_path):
    """Issue 56: --model was read by the last section only, so a typo cost a whole GPU lease. Each argument and
    input the check reads is refused first, every problem in one answer, and nothing is written."""
    earlier = tmp_path / "earlier"
    earlier.with_suffix(".json").write_text('{"sections": []}')
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    done = run_tool("--quick", "--model", str(tmp_path / "typo"), "--out", str(earlier), "--resume",
                    out=not_a_folder)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "[gpu_check]" not in done.stderr
    assert f"--model {tmp_path / 'typo'} is not allowed" in done.stderr
    assert f"--resume: {earlier.with_suffix('.json')} has no 'sections' object with an 'env' object" in done.stderr
    assert f"$OUT {not_a_folder} is not a writable folder" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.json", "file"]


def test_the_shell_wrapper_refuses_a_call_without_the_wheels_it_needs(tmp_path):
    """tools/gpu_check.sh on a machine that lacks a serve dependency (here: a python3 that cannot import
    platformdirs) and a call that did not carry .gpu-wheels: exit 2 naming both, before any install or section."""
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "gpu_check.sh", tmp_path / "tools" / "gpu_check.sh")
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/bash\n[[ "$*" == "-c import platformdirs" ]] && exit 1\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    done = subprocess.run(["bash", str(tmp_path / "tools" / "gpu_check.sh"), "--quick"], capture_output=True,
                          text=True, env={**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}"}, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "gpu_check.sh: platformdirs missing here and no .gpu-wheels folder to install them from" in done.stderr


def test_the_model_must_be_a_class_conditional_bundle_that_runs_the_serve_method(tmp_path):
    from types import SimpleNamespace
    gpu_check_module()
    from gpu_check_inputs import model_problems, token_problems
    bundle = write_tiny_bundle(tmp_path / "target-alone", drafter_too=False)
    assert model_problems(str(bundle), "ar") == [] and model_problems(str(bundle), "auto") == []
    refused = model_problems(str(bundle), "lantern")
    assert refused and refused[0].startswith(f"--serve-method lantern cannot run on --model {bundle}; "
                                             f"allowed: auto, ar")
    sizes = SimpleNamespace(tokens=257, parity_tokens=64, sync_tokens=None)  # on a GPU: the embedded model's image
    assert token_problems(sizes, 256) == ["--tokens 257 is not allowed; allowed: 1..256, the embedded model's "
                                          "tokens per image"]


def test_quick_has_no_time_budget_so_a_busy_machine_skips_nothing():
    """Issue 56: on a loaded machine --quick ran past its 300 s budget, skipped a timing row and exited 1. Its
    units are a check that the tool runs, not a measurement: no budget unless --budget-s names one."""
    gpu_check = gpu_check_module()
    args = gpu_check.parse_args(["--quick"])
    assert args.budget_s is None
    budget = gpu_check.Budget(args.budget_s, scale=0.0)
    budget.section(0.01)
    assert budget.allows(10 ** 9) and budget.left() == budget.overall_left() == float("inf")
    assert gpu_check.parse_args(["--quick", "--budget-s", "5"]).budget_s == 5.0


def test_without_cuda_it_points_to_quick():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = run_tool("--sections", "parity")
    assert done.returncode == 2 and "--quick runs the check on CPU stand-ins" in done.stderr


def test_cuda_syncs_are_counted_from_the_sync_debug_mode_warnings(monkeypatch):
    """FAKE torch.cuda.set_sync_debug_mode (a CPU torch has none): the GPU path counts the warnings torch's
    "warn" mode raises at each synchronising call while the run lasts, each at the project's frame that made it,
    and puts the mode back after."""
    import warnings
    import torch
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def run():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning)
        warnings.warn("something else", UserWarning)
    sites = gpu_check.count_syncs(False, run)
    line = run.__code__.co_firstlineno + 2
    assert sites == {f"tests/docs/test_gpu_check.py:{line} (run)": 3} and modes == ["warn", "default"]


def test_the_budget_is_shared_among_the_sections_that_run_only():
    """A rerun of one section has the whole budget (a lease's last minutes went to waste when it had the share
    it has among all seven); the last section to run has whatever is left."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    assert gpu_check.section_shares(["timing-1"]) == {"timing-1": None}
    shares = gpu_check.section_shares(["parity", "timing-1", "serve"])
    assert shares["serve"] is None and shares["parity"] == pytest.approx(0.18 / (0.18 + 0.2 + 0.12))
    assert gpu_check.section_shares(list(gpu_check.SHARES) + ["timing-rest"])["conformance"] == 0.12


def test_a_cold_process_that_fails_or_hangs_is_reported_with_what_it_said():
    """The cold section's processes: one that exits with an error fails the check, its line naming the error it
    printed (`--json` prints it on stdout); one that outlives its time is killed and reported as timed out, which
    misses the goal but fails nothing."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    env = dict(os.environ)
    error = gpu_check.generate_process(
        [sys.executable, "-c", "import sys; print('{\"error\": \"no bundle here\"}'); sys.exit(2)"], env, 60)
    hung = gpu_check.generate_process([sys.executable, "-c", "import time; time.sleep(60)"], env, 0.5)
    assert error["exit_code"] == 2 and hung["timed_out"]  # killed at its timeout, not waited for
    cold = {"shape": "GPT-B", "goal_first_image_s": 30.0,
            "runs": {"cold_machine": {"flags": "--method ar", "caches": "empty caches", **error},
                     "warm_caches": {"flags": "--method ar", "caches": "warm caches", **hung}}}
    broke, timed_out = gpu_check.cold_lines(cold)
    assert broke.startswith("cold GPT-B --method ar, empty caches: exit 2 after ") and broke.endswith(
        '(goal 30 s: FAIL): {"error": "no bundle here"}')
    assert timed_out.startswith("cold GPT-B --method ar, warm caches: timed out after ")
    record = {"sections": {"cold": cold}}
    assert gpu_check.failed(record)
    del cold["runs"]["cold_machine"]
    assert not gpu_check.failed(record)


def test_results_written_under_out_are_not_copied_onto_themselves(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    monkeypatch.setenv("OUT", str(tmp_path))
    gpu_check.write_all(tmp_path / "gpu-timing", {"quick": False, "sections": {}, "skipped": [], "budget_s": 1.0})
    assert (tmp_path / "gpu-timing.json").exists() and (tmp_path / "gpu-timing.md").exists()


def test_resume_keeps_finished_sections_of_the_same_commit_and_whole_timing_groups_only():
    """A lease too short for the whole check: --resume keeps what an earlier run finished. Sections only at the
    same commit and with nothing skipped; timing only as whole groups (every planned row timed against the AR of
    its own run), so a speed-up never divides one run's time by another's."""
    from types import SimpleNamespace
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    args = SimpleNamespace(method_mode="fused")
    planned = gpu_check.planned_rows(SimpleNamespace(args=args))
    whole = [{"shape": "GPT-B", "images": 1, "sampling": "bundle", "mode": mode, "method": method,
              "fastest_ar": "fused"} for mode, method in planned]
    partial = [dict(r, images=16) for r in whole[:-1]]
    earlier = {"sections": {"env": {"commit": "abc"}, "timing": {"rows": whole + partial},
                            "parity": {"methods": {}}, "sync": {"ar": {}}},
               "skipped": ["sync lantern++: budget"]}
    check = SimpleNamespace(args=args, earlier=earlier, record={"sections": {"env": {"commit": "abc"}}})
    kept = gpu_check.earlier_group(check, "GPT-B", 1, "bundle")
    assert len(kept) == len(planned) and all(r["commit"] == "abc" for r in kept)
    assert gpu_check.earlier_group(check, "GPT-B", 16, "bundle") == []
    assert gpu_check.earlier_section(check, "parity") == {"methods": {}}
    assert gpu_check.earlier_section(check, "sync") is None  # a unit of it was skipped
    check.record["sections"]["env"]["commit"] = "def"
    assert gpu_check.earlier_section(check, "parity") is None
    assert len(gpu_check.earlier_group(check, "GPT-B", 1, "bundle")) == len(planned)


def test_graph_and_fused_rows_read_the_replayed_verify_cost_ratio():
    """A fused or cuda-graph row's forward is a replayed CUDA graph, so its ceiling uses the ratio timed that way;
    an eager row keeps eager's; without a replayed ratio (--quick) every row reads eager's and says so."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    ratios = {"eager": {17: 0.9}, "replayed": {17: 2.0}}
    rows = {mode: {"mode": mode, "verify_width": 17, "tokens_per_forward": 3.0, "wall_s": 1.0, "step_ms": 3.0}
            for mode in ("eager", "graph", "fused")}
    for row in rows.values():
        gpu_check.finish_row(row, "fused", 1.5, ratios, ar_step_ms=1.0)
    assert rows["fused"]["ceiling"] == pytest.approx(1.5) and rows["fused"]["ratio_timed"] == "replayed"
    assert rows["graph"]["beyond_forward_ms"] == pytest.approx(1.0)
    assert rows["eager"]["ceiling"] == pytest.approx(3.0 / 0.9) and rows["eager"]["ratio_timed"] == "eager"
    assert "ratio 2.00 (eager 0.90)" in gpu_check.summary_lines(
        {"sections": {"timing": {"rows": [{**rows["fused"], "shape": "GPT-B", "sampling": "bundle", "images": 1,
                                           "method": "mc-sjd", "peak_memory_gib": 1.0}]}}, "skipped": []})[0]
    quick = {"mode": "fused", "verify_width": 17, "tokens_per_forward": 3.0, "wall_s": 1.0, "step_ms": 3.0}
    gpu_check.finish_row(quick, "fused", 1.5, {"eager": {17: 0.9}}, ar_step_ms=1.0)
    assert quick["ratio_timed"] == "eager" and quick["ceiling"] == pytest.approx(3.0 / 0.9)


WHEELS_BYTES = 2 * 2**20  # .gpu-wheels/ with tools/gpu-wheels.txt's versions: 1.0 MB


def test_the_tracked_tree_leaves_room_for_the_wheels_under_the_device_limit():
    """The device call carries the working tree and .gpu-wheels/, 64 MiB in all: a results file that grows the
    tracked tree past what the wheels leave would cost a rare GPU lease its call, so CI says so first."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tracked = sum((ROOT / name).stat().st_size for name in os.fsdecode(listed).split("\0")
                  if name and (ROOT / name).is_file())
    assert tracked + WHEELS_BYTES <= 64 * 2**20, f"tracked tree {tracked / 2**20:.1f} MiB + wheels > 64 MiB"
