"""The profile suite end to end on the tiny random model: results schema, resumable runs, failed cases, the
batch dimension (step curves and generations per batch size), and the compare report."""
import json
from argparse import Namespace
import os
from pathlib import Path

import pytest

from lantern.cli import main
from lantern.profile import measure
from lantern.profile.hardware import load_profile
from lantern.profile.report import compare
from lantern.profile.schema import SCHEMA_VERSION, SchemaError, load_results, save_results
from lantern.profile.suite import Suite

TINY_PROFILE = """\
# a tiny profile: every kind of case, in seconds
name = "tiny"
backend = "cpu"
dtype = "fp32"
threads = 1
model = "random:GPT-test"
batch_sizes = [1, 2]
verify_sizes = [1, 2, 4, 8, 16]
verify_sizes_by_batch = {2 = [1, 2, 4, 8]}
draft_sizes = [1, 2, 4]
methods = ["ar", "eagle2", "lantern++"]
trees = ["chain-5"]
classes = [0, 1]
warmup = 1
repeats = 1
"""


def run_cli(*argv, capsys) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A profile file and the results of one whole run of it."""
    root = tmp_path_factory.mktemp("profiles")
    path = root / "tiny.toml"
    path.write_text(TINY_PROFILE)
    summary = Suite(load_profile(str(path)), progress=False).run()
    return path, root / "results" / "tiny.json", summary


@pytest.mark.slow
def test_run_writes_a_valid_results_file(tiny_run):
    _, results, summary = tiny_run
    assert summary["failed"] == [] and summary["complete"]
    data = load_results(results)
    assert data["schema_version"] == SCHEMA_VERSION and data["model"]["kind"] == "random"
    kinds = {c["kind"] for c in data["cases"].values()}
    assert kinds == {"verify", "draft", "generate", "calibration"}  # no acceptance probe: nothing reads it
    verify = data["cases"]["verify/b1/N8"]["result"]
    assert verify["latency"]["repeats"] == 1 and verify["latency"]["median_s"] > 0
    assert verify["memory"]["weights_bytes"] > 0 and verify["memory"]["kv_cache_bytes"] > 0
    gen = data["cases"]["generate/b1/lantern++/chain-5"]["result"]
    assert gen["tokens_per_pass"] == 16 and gen["verify_width"] == 6
    prefills = gen["target_forwards"] - gen["verify_steps"]  # each image's first token comes from its prefill
    tokens = gen["tau"] * gen["verify_steps"] + prefills  # tau counts accepted drafts + bonus per verify
    assert gen["step_compression"] == pytest.approx(tokens / gen["target_forwards"])
    env = data["environment"]
    assert env["torch"] and env["logical_cores"] >= 1 and "cpu_model" in env


def test_generations_and_step_curves_at_every_batch_size(tiny_run):
    """At B = 2 the two images are decoded together: every step of the loop advances both, so AR takes the same
    number of steps as at B = 1, and a speculative loop fewer than the two images' steps added up."""
    data = load_results(tiny_run[1])
    cases = data["cases"]
    assert [k for k in cases if k.startswith("verify/b2/")] == ["verify/b2/N1", "verify/b2/N2", "verify/b2/N4",
                                                                  "verify/b2/N8"]  # verify_sizes_by_batch
    assert cases["verify/b2/N8"]["params"] == {"batch": 2, "rows": 4, "N": 8}  # 2 rows per image with CFG
    assert "draft/b2/W4" in cases and "verify/b1/N16" in cases
    for b, classes in ((1, [0]), (2, [0, 1])):
        for method in ("ar", "eagle2", "lantern++/chain-5"):
            case = cases[f"generate/b{b}/{method}"]
            assert case["status"] == "ok" and case["params"]["batch"] == b and case["params"]["classes"] == classes
            r = case["result"]
            assert r["images"] == b and r["tokens_per_pass"] == 16 * b
        ar = cases[f"generate/b{b}/ar"]["result"]
        assert ar["verify_steps"] == 15 and ar["target_forwards"] == 16 * b and ar["tau"] == 1.0
    two = cases["generate/b2/lantern++/chain-5"]["result"]
    image_steps = two["target_forwards"] - 2  # each image's steps (its forwards but the prefill), added up
    assert image_steps / 2 <= two["verify_steps"] < image_steps
    assert two["tau"] == pytest.approx((32 - 2) / image_steps)  # each image's first token comes from its prefill


def test_classes_are_cycled_to_the_batch_size_and_step_sizes_can_differ_per_batch():
    from lantern.profile.hardware import profile_from_dict

    profile = profile_from_dict({"classes": [3, 5], "batch_sizes": [1, 4], "verify_sizes": [1, 8],
                                 "verify_sizes_by_batch": {"4": [1, 2]}})
    assert profile.classes_at(1) == [3] and profile.classes_at(5) == [3, 5, 3, 5, 3]
    assert profile.verify_sizes_at(1) == (1, 8) and profile.verify_sizes_at(4) == (1, 2)
    with pytest.raises(ValueError, match=r"verify_sizes_by_batch has batch size 10, which is not one of "
                                         r"batch_sizes \[1, 4\]"):
        profile_from_dict({"batch_sizes": [1, 4], "verify_sizes_by_batch": {"10": [1, 2]}})
    with pytest.raises(ValueError, match="verify_sizes_by_batch keys are batch sizes"):
        profile_from_dict({"verify_sizes_by_batch": {"b1": [1, 2]}})
    with pytest.raises(ValueError, match=r"at batch size 1 must be a non-empty list of integers >= 1, got \[0\]"):
        profile_from_dict({"verify_sizes_by_batch": {"1": [0]}})


def test_version_1_results_are_refused_saying_how_to_measure_again(tiny_run, tmp_path, capsys):
    data = json.loads(tiny_run[1].read_text())
    data["schema_version"] = 1
    old = tmp_path / "tiny.json"
    old.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=r"version 1 is incompatible; this lantern reads version 2 only \(measure "
                                          r"again with `lantern profile run --profile tiny --fresh`"):
        load_results(old)
    code, out = run_cli("profile", "run", "--profile", str(tiny_run[0]), "--out", str(old), "--no-progress",
                        capsys=capsys)
    assert code == 2 and "--fresh" in out["error"] and json.loads(old.read_text())["schema_version"] == 1


def test_wrong_schema_version_is_refused_with_a_clear_message(tiny_run, tmp_path, capsys):
    data = json.loads(tiny_run[1].read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    bad = tmp_path / "future.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=f"schema version {SCHEMA_VERSION + 1} is incompatible; this lantern "
                                          f"reads version {SCHEMA_VERSION}"):
        load_results(bad)
    code, out = run_cli("profile", "compare", str(tiny_run[1]), str(bad), "--out", str(tmp_path / "r"), capsys=capsys)
    assert code == 2 and "incompatible" in out["error"]
    del data["cases"]
    data["schema_version"] = SCHEMA_VERSION
    with pytest.raises(SchemaError, match="field 'cases'"):
        save_results(data, tmp_path / "broken.json")


def test_second_run_resumes_and_a_failed_case_is_recorded_then_retried(tiny_run, tmp_path, monkeypatch):
    path, results, first = tiny_run
    out = tmp_path / "tiny.json"
    out.write_text(results.read_text())
    again = Suite(load_profile(str(path)), out=out, progress=False).run()
    assert again["ran"] == 0 and again["resumed"] == first["planned"]

    data = json.loads(out.read_text())
    del data["cases"]["verify/b1/N4"]  # as if the run had stopped before this case
    out.write_text(json.dumps(data))
    real = measure.verify_latency

    def broken(backend, target, spec, warmup, repeats):
        if spec.verify_widths == (4,):
            raise RuntimeError("device lost at N=4")
        return real(backend, target, spec, warmup, repeats)
    monkeypatch.setattr(measure, "verify_latency", broken)
    failed = Suite(load_profile(str(path)), out=out, progress=False).run()
    assert failed["ran"] == 1 and failed["failed"] == ["verify/b1/N4"]
    case = load_results(out)["cases"]["verify/b1/N4"]
    assert case["status"] == "failed" and case["error"] == "RuntimeError: device lost at N=4"
    monkeypatch.setattr(measure, "verify_latency", real)
    fixed = Suite(load_profile(str(path)), out=out, progress=False).run()
    assert fixed["ran"] == 1 and fixed["failed"] == [] and load_results(out)["cases"]["verify/b1/N4"]["status"] == "ok"


def test_unavailable_backend_is_one_failed_case_and_exit_code_3(tiny_run, tmp_path, capsys):
    out = tmp_path / "nope.json"
    code, summary = run_cli("profile", "run", "--profile", str(tiny_run[0]), "--backend", "nope", "--out", str(out),
                            "--no-progress", capsys=capsys)
    assert code == 3 and summary["exit_code"] == 3 and not summary["available"]
    data = load_results(out)
    assert not data["backend"]["available"]
    assert data["cases"]["backend"]["error"].startswith("unavailable: unknown backend 'nope'")


def test_bad_profile_is_exit_code_2(capsys):
    code, out = run_cli("profile", "run", "--profile", "no-such-profile", capsys=capsys)
    assert code == 2 and "no-such-profile" in out["error"] and "known:" in out["error"]


def test_compare_writes_one_markdown_report(tiny_run, tmp_path, capsys):
    code, unavailable = run_cli("profile", "run", "--profile", str(tiny_run[0]), "--backend", "nope",
                                "--out", str(tmp_path / "nope.json"), capsys=capsys)
    compare([tiny_run[1], tmp_path / "nope.json"], tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    for heading in ("Verify latency vs tree size N", "Whole generation", "Memory", "Unavailable backends",
                    "Failed cases"):
        assert heading in report
    assert "lantern++/chain-5" in report and "unknown backend 'nope'" in report
    assert [p.name for p in (tmp_path / "report").iterdir()] == ["report.md"]  # every number is in its tables
    # speed-up vs batch size: over AR at the same batch size, one column per batch size
    data = load_results(tiny_run[1])
    wall = {cid: c["result"]["wall"]["median_s"] for cid, c in data["cases"].items() if c["kind"] == "generate"}
    speedups = [wall[f"generate/b{b}/ar"] / wall[f"generate/b{b}/lantern++/chain-5"] for b in (1, 2)]
    assert "## Speed-up vs batch size" in report and "| run | method / tree | B = 1 | B = 2 |" in report
    assert f"| lantern++/chain-5 | {speedups[0]:.2f} | {speedups[1]:.2f} |" in report


def test_a_profile_supplies_generate_its_backend_dtype_and_threads_and_no_tree(tmp_path, monkeypatch):
    """`lantern generate --profile NAME` takes the profile's backend and dtype (unless given) and its threads; the
    tree stays the method's own (`--drafting` or the preset), as no profile holds a tuned tree any more."""
    from lantern.cli.profile import apply_profile
    threads = []
    monkeypatch.setattr("torch.set_num_threads", threads.append)
    (tmp_path / "p.toml").write_text('name = "p"\nbackend = "cpu"\ndtype = "bf16"\nthreads = 3\n')
    args = Namespace(profile=str(tmp_path / "p.toml"), backend=None, dtype="fp32", drafting=None, method="lantern++",
                     classes=[0], batch=None)
    apply_profile(args)
    assert (args.backend, args.dtype, args.drafting, threads) == ("cpu", "fp32", None, [3])


@pytest.mark.parametrize("table", ["[tuned]\ntree_file = \"p.tuned.json\"\n", "[probe]\ndepth = 2\n"])
def test_a_profile_with_a_table_of_the_removed_tuner_is_refused_naming_it(tmp_path, capsys, table):
    """`lantern profile tune` wrote [tuned] and read the [probe] case's acceptance; both are gone, so a profile
    that still has one is bad input (exit 2, the key named), not silently half-read."""
    (tmp_path / "p.toml").write_text(f'name = "p"\n{table}')
    key = table[1:table.index("]")]
    with pytest.raises(ValueError, match=rf"unknown keys \['{key}'\]"):
        load_profile(str(tmp_path / "p.toml"))
    code, out = run_cli("profile", "run", "--profile", str(tmp_path / "p.toml"), capsys=capsys)
    assert code == 2 and f"'{key}'" in out["error"]


def test_committed_results_measured_with_the_tuner_still_load_and_compare(tmp_path):
    """results/cpu.json holds a `tune` object, the acceptance probe and tuned trees' generations: they load, and
    compare reports the tuned generations as cases like any other."""
    committed = Path(__file__).resolve().parents[2] / "results" / "cpu.json"
    data = load_results(committed)
    assert "tune" in data and "acceptance/probe" in data["cases"]
    report = Path(compare([committed], tmp_path / "report")["report"]).read_text()
    assert "| lantern++/tuned-N8-58ec7020 |" in report and "Tuned trees" not in report


def test_auto_source_prefers_the_embedded_bundle(tmp_path, monkeypatch, tiny):
    """With a `lantern.bundle` whose default bundle exists, `auto` loads it and records it as a bundle."""
    import types

    from lantern.profile import source
    from lantern.profile.source import load_source
    target, drafter, proximity = tiny
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(source, "DEFAULT_BUNDLE", tmp_path)
    monkeypatch.setattr(source, "load_bundle", lambda path=None: types.SimpleNamespace(
        path=tmp_path, target=target, drafter=drafter, proximity=proximity, default_cfg_scale=3.0,
        manifest={"files": {"target.safetensors": "ab12"}}, validations={}, acceptance_records={}))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object() if name == "lantern.bundle" else None)
    src = load_source("auto")
    # the embedded bundle is recorded by name, never by the folder it is installed in
    assert src.info["kind"] == "bundle" and src.info["name"] == "bundle" and src.default_cfg_scale == 3.0
    assert load_source(src.info["name"]).info == src.info  # the recorded name loads the same source again
    assert load_source(f"bundle:{tmp_path}").info["name"] == f"bundle:{tmp_path}"  # a bundle elsewhere: its path
    assert src.target is target and src.info["manifest_files"] == {"target.safetensors": "ab12"}


def test_sampling_table_is_the_decoders_sampling_config():
    """[sampling] holds SamplingConfig's fields (validated by it); a missing cfg_scale is the model's default."""
    from lantern.decoding.sampling import SamplingConfig
    from lantern.profile.hardware import profile_from_dict

    profile = profile_from_dict({"sampling": {"top_k": 20}})
    assert profile.sampling_config(model_cfg_scale=5.0) == SamplingConfig(top_k=20, cfg_scale=5.0)
    assert profile_from_dict({"sampling": {"cfg_scale": 2.0}}).sampling_config(5.0).cfg_scale == 2.0
    with pytest.raises(ValueError, match=r"profile 'default': \[sampling\] temperature 0 must be > 0"):
        profile_from_dict({"sampling": {"temperature": 0}})
    with pytest.raises(ValueError, match=r"unknown keys \['topk'\] in \[sampling\]"):
        profile_from_dict({"sampling": {"topk": 20}})


def test_profiles_are_found_on_the_search_path_then_in_the_shipped_copy(tmp_path, monkeypatch):
    """$LANTERN_PROFILES (several folders), ./profiles, then the profiles installed with lantern, from any folder;
    results of a shipped profile go to ./results, never into the installed package."""
    from lantern.profile.hardware import shipped_dir
    from lantern.profile.suite import default_results_path

    monkeypatch.chdir(tmp_path)
    shipped = load_profile("cpu")
    assert shipped.path.parent == shipped_dir() and (shipped_dir() / "onnx-cpu.toml").is_file()
    assert default_results_path(shipped) == tmp_path.joinpath("results", "cpu.json").relative_to(tmp_path)
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (second / "cpu.toml").write_text('name = "cpu"\nbackend = "cpu"\n')
    monkeypatch.setenv("LANTERN_PROFILES", f"{first}{os.pathsep}{second}")
    mine = load_profile("cpu")
    assert mine.path == second / "cpu.toml" and default_results_path(mine) == second / "results" / "cpu.json"


def test_run_calibrates_auto_per_batch_size_and_generate_auto_reads_it(tiny_run, capsys):
    """`profile run` times every auto plan at each batch size, refreshes the machine's cached calibration, and
    `--method auto --profile` takes its cost model from the results (interpolated between batch sizes)."""
    from lantern.api import ModelDefaults, Pipeline
    from lantern.plan import calibration
    from lantern.cli.profile import profile_costs
    from lantern.profile.source import load_source
    path, results, _ = tiny_run
    data = load_results(results)
    entries = {c["params"]["batch"]: c["result"] for c in data["cases"].values() if c["kind"] == "calibration"}
    assert sorted(entries) == [1, 2]
    for entry in entries.values():
        # the relaxed preset's k = 10 runs at 4, 1/16 of the tiny model's 64 codes (lantern.plan.validated)
        assert entry["fixed_s"] > 0 and {"ar", "mc-sjd/L4", "eagle2", "lantern++/chain-5@k=4"} <= set(entry["plans"])
        assert all(p["step_s"] > 0 for p in entry["plans"].values())
    src = load_source("random:GPT-test")
    pipe = Pipeline(src.target, src.drafter, src.proximity, backend="cpu",
                    defaults=ModelDefaults(sampling=load_profile(str(path)).sampling_config(src.default_cfg_scale)))
    key = calibration.pipe_key(pipe, pipe.defaults.sampling)
    assert calibration.load_calibration(key)["widths"]["2"] == {k: v for k, v in entries[2].items()
                                                               if k not in ("model", "cache")}
    costs = profile_costs(str(path))
    assert costs.name == "tiny" and set(costs.widths) == {"1", "2"}
    choice = pipe.plan(3, batch=3, profile=costs, progress=False)
    assert choice.cost_source.startswith("hardware profile tiny (interpolated between batch widths [1, 2])")
