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


def test_generate_json_reports_every_field_and_same_seed_same_tokens(tmp_path):
    runs = [lantern("generate", "--classes", "3", "5", "--method", "ar", "--seed", "11", "--out", str(tmp_path / d),
                    "--json") for d in ("a", "b")]
    outs = [json.loads(r.stdout) for r in runs]
    assert all(r.returncode == 0 for r in runs)
    assert FIELDS <= set(outs[0])
    assert outs[0]["tokens"] == outs[1]["tokens"] and len(outs[0]["tokens"]) == 2
    assert outs[0]["backend"] == "cpu" and outs[0]["num_tokens"] == 512
    assert all(os.path.isfile(p) for p in outs[0]["image_paths"] + [outs[0]["grid_path"]])


def test_speculative_generate_reports_acceptance(tmp_path):
    r = lantern("generate", "--classes", "1", "--method", "lantern++", "--drafting", "chain-5", "--lam", "1",
                "--greedy", "--no-images", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["mean_accepted_length"] > 1.0  # the trained drafter gets tokens accepted
    assert out["target_forwards"] < 256 and set(out["phase_seconds"]) >= {"draft", "verify", "accept", "commit"}
    ar = json.loads(lantern("generate", "--classes", "1", "--method", "ar", "--greedy", "--no-images", "--json").stdout)
    assert ar["tokens"] == out["tokens"]  # greedy + exact acceptance is lossless


@pytest.mark.parametrize("args, code, message", [
    (["--classes", "12"], 2, "class id 12 is out of range; allowed: integers 0..9"),
    (["--lam", "0.5"], 2, "lambda 0.5 must be a finite number >= 1"),
    (["--k", "5000"], 2, "k 5000 exceeds the proximity table"),
    (["--batch", "0"], 2, "batch 0 must be an integer >= 1"),
    (["--method", "lantern", "--delta", "1.5"], 2, r"delta 1.5 is outside [0, 1]"),
    (["--drafting", "no-such-tree"], 2, "neither a preset"),
    (["--backend", "tpu"], 2, "unknown backend 'tpu'"),
    (["--dtype", "fp8"], 2, "dtype 'fp8' is not supported"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, args, code, message):
    out_dir = tmp_path / "out"
    r = lantern("generate", "--out", str(out_dir), "--json", *args)
    assert r.returncode == code, r.stderr
    assert message in json.loads(r.stdout)["error"]
    assert not out_dir.exists()


def test_unavailable_backend_exits_3():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = lantern("generate", "--backend", "cuda", "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["error"].startswith("cuda: ")


def test_bad_tree_file_is_named(tmp_path):
    tree = tmp_path / "tree.json"
    tree.write_text("[[0], [0, 0, 0]]")
    r = lantern("generate", "--drafting", str(tree), "--json")
    assert r.returncode == 2 and "not prefix-closed" in json.loads(r.stdout)["error"]
