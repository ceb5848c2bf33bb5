"""The HPU backend's contract, run against a FAKE `habana_frameworks` (tests/fakes/fake_habana_frameworks.py).

The fake runs on the CPU and records what the real bridge would: every module `wrap_in_hpu_graph` wraps, the
graph keys it would capture (one per distinct input shape and non-tensor argument), and mark_step calls.
Nothing here proves HPU numerics or speed; it proves the backend's calls: one graph key per static step over
whole generations, mark_step after every step, outputs cloned off the replayed graph's buffers, and clear
reasons when the bridge is missing, broken, in the wrong mode, or sees no device.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from fakes.fake_habana_frameworks import hide, install
from lantern.backends import BackendUnavailable, StaticSpec, get_backend, resolve_name
from lantern.backends import hpu as hpu_backend
from lantern.backends.base import describe
from lantern.decoding.loop import static_spec
from test_graph_mode import DRAFTING, decode_configs, generate, spec_for, step_loop

NOT_INSTALLED = ("hpu: habana_frameworks is not installed (install Habana's PyTorch bridge, then "
                 "pip install lantern[hpu])")


@pytest.fixture(scope="module")
def models(tiny):
    """conftest's tiny target (peaked, so trees get accepted) and drafter."""
    return tiny[0], tiny[1]


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    recorder = install(monkeypatch)
    monkeypatch.setattr(hpu_backend, "DEVICE_TYPE", "cpu")  # the fake's tensors live on the CPU
    return recorder


def test_without_the_bridge_the_reason_is_exact(monkeypatch):
    hide(monkeypatch)
    row = describe(hpu_backend.HPUBackend)
    assert not row["available"] and f"hpu: {row['reason']}" == NOT_INSTALLED
    with pytest.raises(BackendUnavailable) as err:
        get_backend("hpu")
    assert str(err.value) == NOT_INSTALLED
    assert resolve_name("auto") != "hpu"


def test_broken_bridge_wrong_mode_and_no_device_are_reported(fake, monkeypatch):
    assert get_backend("hpu").availability().ok and resolve_name("auto") == "hpu"
    assert os.environ["PT_HPU_LAZY_MODE"] == "1"  # set explicitly before the bridge is imported
    fake.available = False
    assert "no Gaudi device is visible" in describe(hpu_backend.HPUBackend)["reason"]
    fake.available = True
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    with pytest.raises(BackendUnavailable, match=r"PT_HPU_LAZY_MODE=0, but HPU graphs run only in lazy mode"):
        get_backend("hpu")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    backend = get_backend("hpu")
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.core", None)
    assert "habana_frameworks failed to import" in describe(hpu_backend.HPUBackend)["reason"]
    with pytest.raises(BackendUnavailable, match=r"^hpu: habana_frameworks failed to import"):
        backend.prepare(None, None, None)


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
    hpu.warmup()
    eager.warmup()
    for a, b in zip(step_loop(eager, rounds=2), step_loop(hpu, rounds=2)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("drafting", list(DRAFTING))
def test_whole_generations_use_one_graph_per_static_step(fake, models, tiny, drafting):
    cfg = models[0].config
    configs = decode_configs(drafting)
    spec = static_spec(configs[0][1], cfg, images=1, dtype="bf16")
    runner = get_backend("hpu").prepare(*models, spec)
    eager = get_backend("cpu").prepare(*models, spec)
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
        ids = generate(runner, dcfg, cls, proximity)
        if dcfg.sampling.greedy:
            assert torch.equal(ids, generate(eager, dcfg, cls, proximity))

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
