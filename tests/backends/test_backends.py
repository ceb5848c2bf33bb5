"""Backend selection: names, $LANTERN_BACKEND, availability reasons, the entry-point group."""
import json
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest
import torch

import lantern.backends.registry as registry
from lantern.backends import Availability, BackendUnavailable, StaticSpec, get_backend, resolve_name, valid_names
from lantern.backends.base import dummy_step_inputs


def test_unknown_backend_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; valid backends: auto, .*cpu"):
        get_backend("tpu")


def test_env_var_selects_and_the_argument_overrides(monkeypatch):
    monkeypatch.setenv("LANTERN_BACKEND", "cpu")
    assert resolve_name(None) == "cpu"
    monkeypatch.setenv("LANTERN_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="unknown backend 'nonsense'"):
        resolve_name(None)
    assert resolve_name("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_known_but_unavailable_backend_says_why():
    with pytest.raises(BackendUnavailable, match=r"^cuda: torch.cuda.is_available\(\) is False"):
        get_backend("cuda")


@pytest.mark.parametrize("available, expected", [({"hpu"}, "hpu"), ({"cuda", "hpu"}, "hpu"), ({"cuda"}, "cuda"),
                                                  (set(), "cpu")])
def test_auto_takes_the_first_available_of_hpu_cuda_cpu(monkeypatch, available, expected):
    """FAKE availabilities: auto tries hpu, then cuda, and falls back to cpu."""
    def fake_class(name):
        ok = name in available or name == "cpu"
        return type(name, (), {"availability": classmethod(lambda cls: Availability(ok, "" if ok else "fake"))})

    monkeypatch.setattr(registry, "backend_class", fake_class)
    assert resolve_name("auto") == expected


def test_entry_point_group_adds_out_of_tree_backends(monkeypatch):
    """A FAKE entry point (as a third-party package would declare in group `lantern.backends`)."""
    fake = EntryPoint(name="fake-accel", value="lantern.backends.torch_eager:CPUBackend", group="lantern.backends")
    monkeypatch.setattr(registry, "entry_points", lambda group: [fake] if group == "lantern.backends" else [])
    assert "fake-accel" in valid_names()
    assert get_backend("fake-accel").capabilities().device == "cpu"


def test_static_spec_rejects_shapes_that_cannot_fit():
    with pytest.raises(ValueError, match=r"step widths \(1, 64\) must be in \[1, max_len - prefix_len = 15\]"):
        StaticSpec(batch=1, max_len=16, prefix_len=1, verify_widths=(1, 64))
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        StaticSpec(batch=1, max_len=16, prefix_len=1, verify_widths=(1,), dtype="fp8")


def test_bf16_runner_tracks_fp32_reference(tiny):
    target, drafter, _ = tiny
    spec32 = StaticSpec(batch=2, max_len=32, prefix_len=1, verify_widths=(4,), draft_widths=(4,))
    spec16 = StaticSpec(**{**spec32.__dict__, "dtype": "bf16"})
    outs = []
    for spec in (spec32, spec16):
        r = get_backend("cpu").prepare(target, drafter, spec)
        r.warmup()
        outs.append(r.verify(*dummy_step_inputs(spec, 4, "cpu")).logits)
        assert outs[-1].dtype == torch.float32
        prof = r.profile()
        assert prof["memory"]["kv_cache_bytes"] == (2 * 2 * 32 * 4 * 16 * 2 + 2 * 32 * 4 * 16 * 2) * (
            4 if spec.dtype == "fp32" else 2)
    scale = outs[0].abs().max()
    assert (outs[0] - outs[1]).abs().max() / scale < 0.05


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "lantern.cli", *args], capture_output=True, text=True, env=env)


def test_cli_backends_json_and_exit_codes(monkeypatch, capsys):
    """The listing as a user runs it (a process of its own); the refused $LANTERN_BACKEND in process."""
    from lantern.cli import main
    ok = run_cli("backends", "--json")
    assert ok.returncode == 0
    out = json.loads(ok.stdout)
    assert {row["name"] for row in out["backends"]} >= {"cpu", "cuda"}
    cpu = next(r for r in out["backends"] if r["name"] == "cpu")
    assert cpu["available"] and cpu["device"] == "cpu" and "fp32" in cpu["dtypes"]
    monkeypatch.setenv("LANTERN_BACKEND", "nope")
    assert main(["backends", "--json"]) == 2
    assert "unknown backend 'nope'" in json.loads(capsys.readouterr().out)["error"]
