"""`lantern generate` end to end on the embedded model: JSON fields, reproducibility, exit codes."""
import json
import os
import subprocess
import sys

import pytest

FIELDS = {"backend", "device", "dtype", "mode", "image_paths", "grid_path", "tokens", "num_tokens", "target_forwards",
          "mean_accepted_length", "phase_seconds", "wall_seconds", "peak_memory_bytes", "memory", "stats"}


def lantern(*args, env=None):
    return subprocess.run([sys.executable, "-m", "lantern.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow
def test_generate_json_reports_every_field_and_same_seed_same_tokens(tmp_path, capsys):
    """The first run as a user runs it (a process of its own), the second in process."""
    from lantern.cli import main
    argv = ["generate", "--classes", "3", "5", "--method", "ar", "--seed", "11", "--json", "--out"]
    first = lantern(*argv, str(tmp_path / "a"))
    assert first.returncode == 0 and main(argv + [str(tmp_path / "b")]) == 0
    outs = [json.loads(first.stdout), json.loads(capsys.readouterr().out)]
    assert FIELDS <= set(outs[0])
    assert outs[0]["tokens"] == outs[1]["tokens"] and len(outs[0]["tokens"]) == 2
    assert outs[0]["backend"] == "cpu" and outs[0]["num_tokens"] == 512
    assert all(os.path.isfile(p) for p in outs[0]["image_paths"] + [outs[0]["grid_path"]])


@pytest.mark.slow
def test_speculative_generate_reports_acceptance(tmp_path, capsys):
    from lantern.cli import main
    r = lantern("generate", "--classes", "1", "--method", "lantern++", "--drafting", "chain-5", "--lam", "1",
                "--greedy", "--no-images", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["mean_accepted_length"] > 1.0  # the trained drafter gets tokens accepted
    assert out["target_forwards"] < 256 and set(out["phase_seconds"]) >= {"draft", "verify", "accept", "commit"}
    assert main(["generate", "--classes", "1", "--method", "ar", "--greedy", "--no-images", "--json"]) == 0
    ar = json.loads(capsys.readouterr().out)  # in process
    assert ar["tokens"] == out["tokens"]  # greedy + exact acceptance is lossless


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    from tiny_bundle import write_tiny_bundle
    return write_tiny_bundle(tmp_path_factory.mktemp("tiny-bundle"), drafter_too=False)


def test_num_images_makes_that_many_images_of_each_class(tiny_bundle, tmp_path, capsys):
    """--num-images N: N images of each class id, one after another, each from its own seed (docs/engine.md), so
    `--seed <its seed> --classes <its class>` reproduces any one of them alone."""
    from lantern.cli import main
    out_dir = tmp_path / "out"
    argv = ["generate", "--model", str(tiny_bundle), "--method", "ar", "--scale", "1", "--json"]
    assert main(argv + ["--classes", "3", "1", "--num-images", "3", "--seed", "5", "--out", str(out_dir)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["classes"] == [3, 3, 3, 1, 1, 1] and len(out["tokens"]) == 6 and len(set(out["seeds"])) == 6
    assert [os.path.basename(p) for p in out["image_paths"]] == [
        f"{i:03d}_class{c}_seed{s}.png" for i, (c, s) in enumerate(zip(out["classes"], out["seeds"]))]
    assert all(os.path.isfile(p) for p in out["image_paths"])
    assert main(argv + ["--classes", "1", "--seed", str(out["seeds"][4]), "--no-images"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [out["tokens"][4]]


@pytest.mark.parametrize("args, code, message", [
    (["--classes", "12"], 2, "class id 12 is out of range; allowed: integers 0..9"),
    (["--method", "lantern++", "--k", "5000"], 2, "k 5000 exceeds the proximity table"),
    (["--method", "lantern++", "--drafting", "no-such-tree"], 2, "neither a preset"),
    (["--backend", "tpu"], 2, "unknown backend 'tpu'"),
    (["--dtype", "fp8"], 2, "dtype 'fp8' is not supported"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, code, message):
    """In process (a subprocess's exit code 2 is checked by test_unwritable_output_is_found_before_generation)."""
    from lantern.cli import main
    out_dir = tmp_path / "out"
    assert main(["generate", "--out", str(out_dir), "--json", *args]) == code
    assert message in json.loads(capsys.readouterr().out)["error"]
    assert not out_dir.exists()


@pytest.mark.parametrize("args, message", [
    (["--method", "lantern++", "--lam", "0.5"], "argument --lam: 0.5 is not allowed; allowed: a finite number >= 1"),
    (["--method", "lantern", "--delta", "1.5"], "argument --delta: 1.5 is not allowed; allowed: a finite number in "
                                                "[0, 1]"),
    (["--delta", "nan"], "argument --delta: nan is not allowed; allowed: a finite number in [0, 1]"),
    (["--lam", "inf"], "argument --lam: inf is not allowed; allowed: a finite number >= 1"),
    (["--cfg-scale", "inf"], "argument --cfg-scale: inf is not allowed; allowed: a finite number >= 1"),
    (["--cfg-scale", "nan"], "argument --cfg-scale: nan is not allowed"),
    (["--temperature=-inf"], "argument --temperature: -inf is not allowed; allowed: a finite number > 0"),
    (["--temperature", "0"], "argument --temperature: 0 is not allowed; allowed: a finite number > 0"),
    (["--top-p", "nan"], "argument --top-p: nan is not allowed; allowed: a finite number in (0, 1]"),
    (["--top-k", "-1"], "argument --top-k: -1 is not allowed; allowed: an integer >= 0"),
    (["--k", "x"], "argument --k: 'x' is not an integer; allowed: an integer >= 0"),
    (["--scale", "0"], "argument --scale: 0 is not allowed; allowed: an integer >= 1"),
    (["--scale", "-2"], "argument --scale: -2 is not allowed; allowed: an integer >= 1"),
    (["--batch", "0"], "argument --batch: 0 is not allowed; allowed: an integer >= 1"),
])
def test_bad_numbers_exit_2_before_any_work(tmp_path, capsys, args, message):
    """In process (the flags are refused while parsing): exit 2, the flag, the value and what is allowed."""
    from lantern.cli import main
    out_dir = tmp_path / "out"
    assert main(["generate", "--out", str(out_dir), "--json", *args]) == 2
    out = json.loads(capsys.readouterr().out)
    assert message in out["error"] and out["exit_code"] == 2
    assert not out_dir.exists()


def test_bad_flags_of_other_commands_exit_2_in_process(tmp_path, capsys):
    """eval, export-onnx and profile calibrate take the same checked numbers (in process: these exit before any
    model is loaded)."""
    from lantern.cli import main
    cases = [(["eval", "--n-per-class", "0", "--json"], "argument --n-per-class: 0 is not allowed"),
             (["eval", "--cfg-scale", "nan", "--json"], "argument --cfg-scale: nan is not allowed"),
             (["export-onnx", "--out", str(tmp_path / "g"), "--cfg-scale", "inf", "--json"],
              "argument --cfg-scale: inf is not allowed"),
             (["export-onnx", "--out", str(tmp_path / "g"), "--batch", "0", "--json"],
              "argument --batch: 0 is not allowed; allowed: an integer >= 1"),
             (["profile", "calibrate", "--top-k", "-1", "--json"],
              "argument --top-k: -1 is not allowed; allowed: an integer >= 0")]
    for argv, message in cases:
        assert main(argv) == 2, argv
        out = json.loads(capsys.readouterr().out)
        assert message in out["error"] and out["exit_code"] == 2
    assert not (tmp_path / "g").exists()


def test_gaudi_config_is_an_hpu_option(tmp_path, capsys):
    from lantern.cli import main
    assert main(["generate", "--backend", "cpu", "--gaudi-config", str(tmp_path), "--json"]) == 2
    assert "--gaudi-config is an option of the hpu backend; the backend here is 'cpu'" in json.loads(
        capsys.readouterr().out)["error"]


def test_fused_step_is_a_graph_backend_option(capsys):
    from lantern.cli import build_parser, main
    from lantern.cli.options import backend_options
    assert main(["generate", "--backend", "cpu", "--fused-step", "--json"]) == 2
    assert ("--fused-step is an option of the backends that declare a fused step (cpu-graph, cuda-graph, hpu); the "
            "backend here is 'cpu'") in json.loads(capsys.readouterr().out)["error"]
    args = build_parser().parse_args(["generate", "--backend", "cpu-graph", "--fused-step"])
    assert backend_options(args) == {"fused_step": True}


def test_unwritable_output_is_found_before_generation(tmp_path, capsys):
    """--out under a file, or on a file system that refuses writes: exit 2 at once (no model is loaded, so this
    takes well under the seconds a generation would), nothing written. The first case runs as a user runs it (a
    process of its own, its exit code the shell's); the others in process."""
    from lantern.cli import main
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = lantern("generate", "--classes", "1", "--out", str(blocker / "out"), "--json")
    assert r.returncode == 2 and f"{blocker} is a file, not a folder" in json.loads(r.stdout)["error"]
    assert blocker.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert main(["generate", "--out", str(blocker), "--json"]) == 2
    assert "exists and is not a folder" in json.loads(capsys.readouterr().out)["error"]
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o555)
    unwritable = read_only if os.geteuid() != 0 else "/sys/lantern-out"  # root writes through mode bits
    assert main(["generate", "--out", os.path.join(unwritable, "out"), "--json"]) == 2
    assert "is not writable" in json.loads(capsys.readouterr().out)["error"]
    assert not any(read_only.iterdir())


def test_export_onnx_and_profile_check_their_outputs_first(tmp_path, capsys):
    from lantern.cli import main
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for argv in (["export-onnx", "--method", "ar", "--out", str(blocker / "graphs"), "--json"],
                 ["profile", "compare", str(tmp_path / "r.json"), "--out", str(blocker / "report"), "--json"],
                 ["profile", "run", "--out", str(blocker / "r.json"), "--json"]):
        assert main(argv) == 2, argv
        assert f"{blocker} is a file, not a folder" in json.loads(capsys.readouterr().out)["error"]


def test_unavailable_backend_exits_3():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = lantern("generate", "--backend", "cuda", "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["error"].startswith("cuda: ")


def test_bad_tree_file_is_named(tmp_path, capsys):
    from lantern.cli import main
    tree = tmp_path / "tree.json"
    tree.write_text("[[0], [0, 0, 0]]")
    assert main(["generate", "--method", "lantern++", "--drafting", str(tree), "--json"]) == 2
    assert "not prefix-closed" in json.loads(capsys.readouterr().out)["error"]
