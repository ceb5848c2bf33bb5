"""The profile suite end to end on the tiny random model: results schema, resumable runs, failed cases, the
batch dimension (step curves, generations and tuned trees per batch size), compare report with plots, and tree
tuning from synthetic and measured numbers."""
import json
from argparse import Namespace
import os
from pathlib import Path

import pytest

from lantern.cli import main
from lantern.decoding.trees import TREE_PRESETS, load_tree
from lantern.profile import measure
from lantern.profile.hardware import load_profile
from lantern.profile.report import compare
from lantern.profile.schema import SCHEMA_VERSION, SchemaError, load_results, save_results
from lantern.profile.suite import Suite
from lantern.plan.cost_model import CostModel
from lantern.profile.tune import AcceptanceRates, choose_tree, evaluate

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
trees = ["chain-5", "tuned"]
classes = [0, 1]
warmup = 1
repeats = 1

[probe]  # keep this comment
depth = 3
fanout = 3
expand = [1, 2, 2]
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
    assert kinds == {"verify", "draft", "generate", "acceptance", "calibration"}
    verify = data["cases"]["verify/b1/N8"]["result"]
    assert verify["latency"]["repeats"] == 1 and verify["latency"]["median_s"] > 0
    assert verify["memory"]["weights_bytes"] > 0 and verify["memory"]["kv_cache_bytes"] > 0
    gen = data["cases"]["generate/b1/lantern++/chain-5"]["result"]
    assert gen["tokens_per_pass"] == 16 and gen["verify_width"] == 6
    prefills = gen["target_forwards"] - gen["verify_steps"]  # each image's first token comes from its prefill
    tokens = gen["tau"] * gen["verify_steps"] + prefills  # tau counts accepted drafts + bonus per verify
    assert gen["step_compression"] == pytest.approx(tokens / gen["target_forwards"])
    probe = data["cases"]["acceptance/probe"]["result"]
    assert len(probe["rates"]) == 3 and all(0 <= r <= 1 for row in probe["rates"] for r in row)
    env = data["environment"]
    assert env["torch"] and env["logical_cores"] >= 1 and "cpu_model" in env
    assert not any("tuned" in k for k in data["cases"])  # no tuned tree yet: nothing planned


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
    assert cases["acceptance/probe"]["params"]["classes"] == [0, 1]  # the probe decodes each class, at batch 1


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


def test_compare_writes_markdown_and_plots(tiny_run, tmp_path, capsys):
    code, unavailable = run_cli("profile", "run", "--profile", str(tiny_run[0]), "--backend", "nope",
                                "--out", str(tmp_path / "nope.json"), capsys=capsys)
    out = compare([tiny_run[1], tmp_path / "nope.json"], tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    for heading in ("Verify latency vs tree size N", "Whole generation", "Memory", "Unavailable backends",
                    "Failed cases"):
        assert heading in report
    assert "lantern++/chain-5" in report and "unknown backend 'nope'" in report
    assert set(out["plots"]) == {"latency vs N", "speed-up", "speed-up vs batch", "memory"}
    # speed-up vs batch size: over AR at the same batch size, one column per batch size
    data = load_results(tiny_run[1])
    wall = {cid: c["result"]["wall"]["median_s"] for cid, c in data["cases"].items() if c["kind"] == "generate"}
    speedups = [wall[f"generate/b{b}/ar"] / wall[f"generate/b{b}/lantern++/chain-5"] for b in (1, 2)]
    assert "## Speed-up vs batch size" in report and "| run | method / tree | B = 1 | B = 2 |" in report
    assert f"| lantern++/chain-5 | {speedups[0]:.2f} | {speedups[1]:.2f} |" in report
    for png in out["plots"].values():
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def synthetic_acceptance(depth=6, ranks=10) -> AcceptanceRates:
    """Rank j accepted given its parent reached: 0.5 * 0.6**j, a little lower at each depth."""
    return AcceptanceRates(tuple(tuple(0.5 * 0.6 ** j * 0.95 ** d for j in range(ranks)) for d in range(depth)))


def test_flat_verify_latency_gets_a_bigger_tree_than_steep():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    draft = {1: 1e-3, 4: 1e-3, 8: 1.1e-3, 16: 1.2e-3}
    flat = CostModel.from_curves({n: 10e-3 for n in sizes}, draft)
    steep = CostModel.from_curves({n: 1e-3 + 1e-3 * n for n in sizes}, draft)
    acc = synthetic_acceptance()
    wide, small = choose_tree(acc, flat), choose_tree(acc, steep)
    assert wide["N"] > 2 * small["N"]
    assert wide["N"] > 57 and small["N"] < 26
    assert wide["tokens_per_s"] == pytest.approx(evaluate(wide["paths"], acc, flat)["tokens_per_s"])
    # on its own device, the chosen tree beats every preset under the same model
    for cost, chosen in ((flat, wide), (steep, small)):
        for paths in TREE_PRESETS.values():
            assert chosen["tokens_per_s"] >= evaluate(paths, acc, cost)["tokens_per_s"] - 1e-9


@pytest.mark.parametrize("name", ["cpu.json", "cpu-bf16.json"])
def test_tune_chooses_again_the_trees_the_committed_results_recorded(name):
    """A change to the tuner keeps the choices of the recorded measurements (the committed files' own tune tables),
    or says so here."""
    from lantern.profile.tune import tune_results
    data = load_results(Path(__file__).resolve().parents[2] / "results" / name)
    tuned = tune_results(data, TREE_PRESETS)
    for b, recorded in data["tune"]["batches"].items():
        assert [list(p) for p in tuned["batches"][int(b)]["choice"]["paths"]] == recorded["choice"]["paths"], b


def generate_args(profile, classes, batch=None) -> Namespace:
    """The flags of `lantern generate --profile` that apply_profile reads, after apply_profile."""
    from lantern.cli.profile import apply_profile
    args = Namespace(profile=str(profile), backend=None, dtype=None, drafting=None, method="lantern++",
                     classes=classes, batch=batch)
    apply_profile(args)
    return args


def test_tune_writes_a_tree_per_batch_size_keeping_comments_and_runs_pick_them_up(tiny_run, tmp_path, capsys):
    path, results, _ = tiny_run
    profile = tmp_path / "tiny.toml"
    profile.write_text(path.read_text())
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "tiny.json").write_text(results.read_text())
    for _ in range(2):  # tuning twice replaces the [tuned] table
        code, out = run_cli("profile", "tune", "--profile", str(profile), capsys=capsys)
        assert code == 0 and list(out["batches"]) == ["1", "2"]
    text = profile.read_text()
    assert text.startswith(TINY_PROFILE) and "# keep this comment" in text
    assert [text.count(t) for t in ("[tuned]", "[tuned.b1]", "[tuned.b2]")] == [1, 1, 1]
    tuned = load_profile(str(profile))
    trees = {b: tmp_path / f"tiny.tuned.b{b}.json" for b in (1, 2)}
    assert tuned.tuned_tree_names() == {b: f.name for b, f in trees.items()}
    saved = load_results(tmp_path / "results" / "tiny.json")["tune"]["batches"]
    for b, tree_file in trees.items():
        chosen = out["batches"][str(b)]
        assert load_tree(str(tree_file)) == tuple(map(tuple, chosen["tree"])) and chosen["N"] == len(chosen["tree"]) + 1
        assert tuned.tuned[f"b{b}"]["N"] == chosen["N"] and saved[str(b)]["choice"]["N"] == chosen["N"]
        assert saved[str(b)]["cost_model"]["verify"][-1][0] == (16 if b == 1 else 8)  # the curve measured at b
        assert out["written"]["tree_files"][str(b)] == str(tree_file)

    again = Suite(tuned, progress=False).run()  # `tuned` is now a tree at each batch size: two new cases
    assert again["ran"] == 2 and again["failed"] == []
    ran = load_results(again["results"])["cases"]
    for b in (1, 2):
        label = f"generate/b{b}/lantern++/tuned-N{out['batches'][str(b)]['N']}-"
        assert [k for k in ran if k.startswith(label)] and ran[next(k for k in ran if k.startswith(label))]["params"][
            "decode"]["drafting"] == str(trees[b])

    report = compare([again["results"]], tmp_path / "report", with_plots=False)["report"]
    for b in (1, 2):  # the report lists each batch size's tuned tree
        assert f", B = {b}: chose N {out['batches'][str(b)]['N']}, depth" in open(report).read()

    args = generate_args(profile, classes=[0, 1, 2, 3])  # 4 images, default --batch 16: width 4, tuned at 2
    assert args.backend == "cpu" and args.dtype == "fp32" and args.drafting == str(trees[2])
    assert generate_args(profile, classes=[0]).drafting == str(trees[1])  # width 1
    assert generate_args(profile, classes=[0, 1, 2], batch=1).drafting == str(trees[1])  # --batch 1: width 1


def test_the_tree_for_a_batch_width_is_the_largest_tuned_one_not_above_it(tmp_path):
    from lantern.profile.hardware import write_tuned
    profile = tmp_path / "p.toml"
    profile.write_text('name = "p"\n# above [tuned]\n')
    write_tuned(profile, {"results": "p.json"}, {4: ({"N": 3}, ((0,), (1,))), 10: ({"N": 2}, ((0,),))})
    p = load_profile(str(profile))
    picked = {b: p.tuned_tree_file(b).name for b in (1, 3, 4, 9, 10, 16)}
    assert picked == {1: "p.tuned.b4.json", 3: "p.tuned.b4.json", 4: "p.tuned.b4.json", 9: "p.tuned.b4.json",
                      10: "p.tuned.b10.json", 16: "p.tuned.b10.json"}  # below every tuned size: the smallest
    assert profile.read_text().startswith('name = "p"\n# above [tuned]\n')
    # a profile tuned before per-batch tuning: its one tree was tuned at batch 1 and serves every width
    (tmp_path / "old.tuned.json").write_text("[[0]]\n")
    (tmp_path / "old.toml").write_text('name = "old"\n[tuned]\ntree_file = "old.tuned.json"\nN = 2\n')
    old = load_profile(str(tmp_path / "old.toml"))
    assert old.tuned_tree_names() == {1: "old.tuned.json"}
    assert generate_args(tmp_path / "old.toml", classes=[0] * 8).drafting == str(tmp_path / "old.tuned.json")
    (tmp_path / "old.tuned.json").unlink()
    with pytest.raises(ValueError, match="its tuned tree .*old.tuned.json is missing; rerun `lantern profile tune"):
        generate_args(tmp_path / "old.toml", classes=[0])
    (tmp_path / "bad.toml").write_text('name = "bad"\n[tuned]\n[tuned.batch4]\ntree_file = "x.json"\n')
    with pytest.raises(ValueError, match=r"unknown table \[tuned.batch4\]; the tables under \[tuned\] are named "
                                         r"b<batch size>"):
        load_profile(str(tmp_path / "bad.toml"))


def test_each_batch_size_gets_the_tree_its_own_curves_call_for():
    """Tuning from a results file: at B = 1 the verify curve is flat (a big tree is nearly free), at B = 4 steep
    (every node must pay for itself), so B = 4 gets a much smaller tree; the acceptance rates are shared."""
    from lantern.profile.tune import tune_results

    def step(kind, b, size, seconds):
        key = {"verify": "N", "draft": "W"}[kind]
        return {"kind": kind, "status": "ok", "params": {"batch": b, key: size},
                "result": {"latency": {"median_s": seconds}}}

    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    cases = {f"verify/b1/N{n}": step("verify", 1, n, 10e-3) for n in sizes}
    cases |= {f"verify/b4/N{n}": step("verify", 4, n, 1e-3 + 1e-3 * n) for n in sizes}
    cases |= {f"draft/b{b}/W{w}": step("draft", b, w, 1e-3) for b in (1, 4) for w in (1, 4, 8, 16)}
    cases["acceptance/probe"] = {"kind": "acceptance", "status": "ok", "params": {},
                                 "result": {"rates": [list(r) for r in synthetic_acceptance().rates]}}
    tuned = tune_results({"cases": cases}, TREE_PRESETS)["batches"]
    assert list(tuned) == [1, 4]
    assert tuned[1]["choice"]["N"] > 57 and tuned[4]["choice"]["N"] < 26
    assert tuned[4]["choice"]["step_s"] == pytest.approx(1e-3 + 1e-3 * tuned[4]["choice"]["N"]
                                                         + tuned[4]["choice"]["depth"] * 1e-3)
    assert tuned[1]["ar_seconds_per_token"] is None  # no AR generation in this file: no predicted speed-up


def test_acceptance_counts_per_depth_and_rank():
    paths = measure.probe_paths(depth=2, fanout=2, expand=(1, 1))
    assert paths == ((0,), (1,), (0, 0), (0, 1))
    # an 8-token image: the prefill gives token 1; the steps accept ranks (0, 1) (tokens 2-4), (1,) (5-6), and
    # nothing (7: every child of the root rejected, with max_accept = 8 - 6 - 1 = 1 not binding)
    counts = measure.count_acceptance(paths, [[(0, 1), (1,), ()]], block=8)
    assert counts["offered"] == [[3, 3], [1, 1]]
    assert counts["accepted"] == [[1, 1], [0, 1]]
    assert counts["rates"] == [[1 / 3, 1 / 3], [0.0, 1.0]]
    # a path cut by the image's token budget says nothing about the children after it
    capped = measure.count_acceptance(paths, [[(0,)]], block=3)  # max_accept = 3 - 1 - 1 = 1 = accepted length
    assert capped["offered"] == [[1, 1], [0, 0]]


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
