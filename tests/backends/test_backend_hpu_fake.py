"""The HPU backend's contract, run against a FAKE `habana_frameworks` (tests/fakes/fake_habana_frameworks.py).

The fake runs on the CPU and records what the real bridge would: every module `wrap_in_hpu_graph` wraps, the
graph keys it would capture (one per distinct input shape and non-tensor argument), and mark_step calls.
Nothing here proves HPU numerics or speed; it proves the backend's calls: one graph key per static step over
whole generations, mark_step after every step, outputs cloned off the replayed graph's buffers, and clear
reasons when the bridge is missing, broken, in the wrong mode, or sees no device.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from fakes.fake_habana_frameworks import hide, install, uninstall
from lantern.backends import BackendUnavailable, StaticSpec, get_backend, resolve_name
from lantern.backends import hpu as hpu_backend
from lantern.backends.base import describe, dummy_step_inputs
from lantern.backends.gaudi_config import FP32_LIST_ENV, LOWER_LIST_ENV
from lantern.engine.step import static_spec
from test_graph_mode import DRAFTING, decode_configs, generate, spec_for, step_loop

NOT_INSTALLED = ("hpu: habana_frameworks is not installed (install Habana's PyTorch bridge, then "
                 "pip install 'lantern-decoding[hpu]')")


@pytest.fixture(scope="module")
def models(tiny):
    """conftest's tiny target (peaked, so trees get accepted) and drafter."""
    return tiny[0], tiny[1]


@pytest.fixture
def fake(monkeypatch):
    for name in ("PT_HPU_LAZY_MODE", "LANTERN_GAUDI_CONFIG", LOWER_LIST_ENV, FP32_LIST_ENV):
        monkeypatch.delenv(name, raising=False)
    recorder = install(monkeypatch)
    monkeypatch.setattr(hpu_backend, "DEVICE_TYPE", "cpu")  # the fake's tensors live on the CPU
    monkeypatch.setattr(hpu_backend, "gaudi_devices", lambda: ["accel0"])  # what sysfs would list
    yield recorder
    uninstall()


def small_spec(dtype: str = "fp32") -> StaticSpec:
    return StaticSpec(batch=2, max_len=32, prefix_len=1, verify_widths=(1,), dtype=dtype)


def test_without_the_bridge_the_reason_is_exact(monkeypatch):
    hide(monkeypatch)
    row = describe(hpu_backend.HPUBackend)
    assert not row["available"] and f"hpu: {row['reason']}" == NOT_INSTALLED
    with pytest.raises(BackendUnavailable) as err:
        get_backend("hpu")
    assert str(err.value) == NOT_INSTALLED
    assert resolve_name("auto") != "hpu"


def test_probing_imports_and_sets_nothing_preparing_sets_lazy_mode(fake, models):
    backend = get_backend("hpu")
    assert backend.availability().ok and resolve_name("auto") == "hpu"
    assert "PT_HPU_LAZY_MODE" not in os.environ and not any(n.startswith("habana_frameworks") for n in sys.modules)
    backend.prepare(models[0], None, small_spec())
    assert fake.imported_with == {"PT_HPU_LAZY_MODE": "1"} and os.environ["PT_HPU_LAZY_MODE"] == "1"


def test_broken_bridge_wrong_mode_and_no_device_are_reported(fake, monkeypatch, models):
    monkeypatch.setattr(hpu_backend, "gaudi_devices", lambda: [])
    assert describe(hpu_backend.HPUBackend)["reason"] == ("no Gaudi device is visible (no habanalabs device in "
                                                          "/sys/class/accel or /sys/class/habanalabs)")
    monkeypatch.setattr(hpu_backend, "gaudi_devices", lambda: ["accel0"])
    fake.available = False  # sysfs lists a device the bridge cannot use: found when preparing
    with pytest.raises(BackendUnavailable, match=r"^hpu: no Gaudi device is visible \(habana_frameworks.torch.hpu"):
        get_backend("hpu").prepare(models[0], None, small_spec())
    fake.available = True
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    with pytest.raises(BackendUnavailable, match=r"PT_HPU_LAZY_MODE=0, but HPU graphs run only in lazy mode"):
        get_backend("hpu")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    uninstall()
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.core", None)  # importing it fails
    assert describe(hpu_backend.HPUBackend)["available"]  # probing imports nothing, so it cannot tell
    with pytest.raises(BackendUnavailable, match=r"^hpu: habana_frameworks failed to import"):
        get_backend("hpu").prepare(models[0], None, small_spec())


def test_gaudi_config_autocast_lists_are_declared_before_the_bridge_is_imported(fake, models, tmp_path,
                                                                                monkeypatch):
    config = tmp_path / "gaudi_config.json"
    config.write_text(json.dumps({"use_torch_autocast": True, "autocast_bf16_ops": ["linear", "matmul"],
                                  "autocast_fp32_ops": ["softmax", "embedding"], "use_fused_adam": True}))
    monkeypatch.setenv("LANTERN_GAUDI_CONFIG", str(tmp_path))  # a folder holding gaudi_config.json
    spec = small_spec("fp32")
    runner = get_backend("hpu").prepare(models[0], None, spec)
    lists = {env: Path(fake.imported_with[env]).read_text().split() for env in (LOWER_LIST_ENV, FP32_LIST_ENV)}
    assert lists == {LOWER_LIST_ENV: ["linear", "matmul"], FP32_LIST_ENV: ["softmax", "embedding"]}
    assert get_backend("hpu").prepare(models[0], None, spec)  # a second runner: the same lists, already declared

    inputs = dummy_step_inputs(spec, 1, "cpu")
    runner.prefill(runner.dummy_condition(), (torch.arange(32) <= 0).expand(2, 1, 32))
    out = runner.verify(*inputs)
    eager = get_backend("cpu").prepare(models[0], None, spec)
    eager.prefill(eager.dummy_condition(), (torch.arange(32) <= 0).expand(2, 1, 32))
    ref = eager.verify(*inputs)
    assert out.logits.dtype == out.hidden.dtype == torch.float32  # the contract's dtypes, autocast or not
    err = ((out.logits - ref.logits).abs().max() / ref.logits.abs().max()).item()
    assert 0 < err < 0.05  # the steps ran under bf16 autocast, not in plain fp32


def test_gaudi_config_errors_are_named(fake, tmp_path, monkeypatch):
    config = tmp_path / "gaudi_config.json"
    config.write_text(json.dumps({"autocast_bf16_ops": "linear"}))
    with pytest.raises(ValueError, match=r"autocast_bf16_ops must be a list of op names, got 'linear'"):
        get_backend("hpu", gaudi_config=str(config))
    with pytest.raises(ValueError, match=r"gaudi config .*missing.json does not exist"):
        get_backend("hpu", gaudi_config=str(tmp_path / "missing.json"))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"autocast_bf16_ops": ["mm"], "autocast_fp32_ops": ["add"]}))
    import habana_frameworks.torch.core  # noqa: F401  imported before any list was declared
    with pytest.raises(ValueError, match=r"must be declared before habana_frameworks.torch.core is imported"):
        get_backend("hpu", gaudi_config=str(other)).prepare(None, None, small_spec())


def test_bf16_default_and_unsupported_dtype(fake, models):
    backend = get_backend("hpu")
    caps = backend.capabilities()
    assert caps.dtypes[0] == "bf16" and caps.supports_graphs
    spec = StaticSpec(batch=2, max_len=32, prefix_len=1, verify_widths=(1,), dtype="fp16")
    with pytest.raises(ValueError, match=r"dtype 'fp16' is not supported by backend 'hpu'; allowed: bf16, fp32"):
        backend.prepare(models[0], None, spec)
    runner = backend.prepare(models[0], None, StaticSpec(batch=2, max_len=32, prefix_len=1, verify_widths=(1,)))
    with pytest.raises(RuntimeError, match="prepared without a drafter"):
        runner.draft(*[torch.zeros(2, 1)] * 5)


def test_outputs_survive_the_next_replay(fake, models):
    """A replay overwrites the graph's output buffers; the runner hands out copies."""
    spec = spec_for(models[0].config, speculative=True, dtype="fp32")
    hpu = get_backend("hpu").prepare(*models, spec)
    eager = get_backend("cpu").prepare(*models, spec)
    eager.trims_attention = False  # the graphs' own static shapes: replays must change nothing, bit for bit
    hpu.warmup()
    eager.warmup()
    for a, b in zip(step_loop(eager, rounds=2), step_loop(hpu, rounds=2)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("drafting", list(DRAFTING))
def test_whole_generations_use_one_graph_per_static_step(fake, models, tiny, drafting):
    cfg = models[0].config
    configs = decode_configs(drafting)
    spec = static_spec(configs[0][1], cfg, batch=1, dtype="bf16")
    runner = get_backend("hpu").prepare(*models, spec)
    eager = get_backend("cpu").prepare(*models, spec)
    eager.trims_attention = False  # the graphs' own static shapes, so greedy ids compare bit for bit
    runner.warmup()
    keys_after_warmup = {label: list(k) for label, k in fake.keys.items()}
    per_module = {label: len(k) for label, k in keys_after_warmup.items()}
    expected = {"TargetPrefill": 1, "TargetStep": len(spec.verify_widths), "CacheCommit": 1,
                "DraftStep": len(spec.draft_widths)}
    assert {label: expected[label.split("#")[0]] for label in fake.wrapped} == per_module
    assert sum(per_module.values()) == len(runner.graph_keys())
    n_warmup_events = len(fake.events)

    proximity = tiny[2]
    for cls, dcfg in configs:
        ids = generate(models, runner, dcfg, cls, proximity)
        if dcfg.sampling.greedy:
            assert torch.equal(ids, generate(models, eager, dcfg, cls, proximity))

    assert fake.keys == keys_after_warmup  # not one new key over whole generations
    steps = fake.step_events()
    graph_calls = [i for i, e in enumerate(steps) if e[0] in ("capture", "replay")]
    assert graph_calls and all(steps[i + 1] == ("mark_step",) for i in graph_calls)
    assert all(e[0] != "capture" for e in fake.events[n_warmup_events:])
    assert ("synchronize",) in fake.events  # phase timing waits for the device
    profile = runner.profile()
    assert profile["graphs"] == runner.graph_keys() and profile["memory_stats"]["fake"]
    assert profile["memory"]["source"] == "habana_frameworks.torch.hpu.max_memory_allocated"


def test_conformance_kit_passes_against_the_fake(fake):
    """The kit's parity, ownership (replays overwrite the graph's outputs: the runner hands out copies), static
    shapes and memory checks, on the FAKE bridge."""
    from lantern.backends.conformance import check_backend
    report = check_backend("hpu", dtypes=["bf16"])
    assert report.passed and len(report.checks) > 5, report.failures()
