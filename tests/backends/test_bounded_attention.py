"""cpu-graph's bounded attention: a compiled verify reads only the cache slots below the engine's bound (the
furthest running root plus the verify's nodes), with that length as the graph's one dynamic dimension, so one
graph serves every length. Per-module graphs and the fused step: the lengths read are the bound's, the tokens
are eager's, nothing recompiles, a bound one slot short changes the tokens, a bound lasts one step, the
calibration floor holds, and the spare cache slot stays unwritten. Dynamo's "eager" backend through a
CompileCounter (tests/backends/test_graph_mode.py runs the same path through inductor)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from conftest import make_models
from lantern.api import Pipeline
from lantern.models.config import GPTConfig
from lantern.decoding import SamplingConfig, method_preset
from lantern.engine import Engine, Request

STREAM = ((0, 12), (1, 5), (2, 9), (3, 12))  # (class, tokens): images finish at different steps, slots refill
METHODS = {"ar": ("ar", {}), "mc-sjd": ("mc-sjd", dict(window=4))}


@pytest.fixture(scope="module")
def models():
    cfg = GPTConfig(dim=64, n_layer=1, n_head=4, vocab_size=64, num_classes=4, block_size=16, multiple_of=32)
    return make_models(cfg)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def decode(method: str):
    name, params = METHODS[method]
    return method_preset(name, SamplingConfig(cfg_scale=2.0, top_k=20), **params)


def run_stream(engine: Engine) -> list:
    for c, t in STREAM:
        engine.submit(Request(c, seed=10 + c, tokens=t))
    return sorted((r.request_id, r.tokens.tolist()) for r in engine.run())


def graph_engine(models, method: str, fused: bool) -> tuple[Engine, CompileCounterWithBackend]:
    counter = CompileCounterWithBackend("eager")
    pipe = Pipeline(*models, backend="cpu-graph", compiler=counter, fused_step=fused)
    engine = Engine(pipe, decode(method), 2)
    engine.warm_up()
    return engine, counter


def reads(engine: Engine, fused: bool) -> list[int]:
    """Records the cache slots each verify reads from now on (fused: each step's span, as the graph sees it)."""
    seen, runner = [], engine.runner
    if fused:
        inside = runner.inside()
        attend = inside.attend
        inside.attend = lambda slots: (seen.append(slots), attend(slots))[-1]
    else:
        verify = runner.steps["verify"]
        runner.steps["verify"] = lambda *args: (seen.append(args[-1].shape[-1]), verify(*args))[-1]
    return seen


def bounds(engine: Engine) -> list[int]:
    """Records the engine's bound at each step, from the slots' roots as the device holds them before the step."""
    seen, step = [], engine._attention_bound

    def bound(busy):
        device_roots = engine.slots.root.tolist()
        seen.append(max(device_roots[i] for i in busy) + max(engine.runner.spec.verify_widths))
        return step(busy)
    engine._attention_bound = bound
    return seen


@pytest.mark.parametrize("fused", [False, True], ids=["per-module", "fused"])
@pytest.mark.parametrize("method", list(METHODS))
def test_each_verify_reads_up_to_the_furthest_running_root_and_gives_eagers_tokens(models, method, fused):
    engine, counter = graph_engine(models, method, fused)
    compiled = counter.frame_count
    read, bound = reads(engine, fused), bounds(engine)
    with torch.compiler.set_stance("fail_on_recompile"):  # every length through the graph of the warm-up
        got = run_stream(engine)
    assert counter.frame_count == compiled
    assert got == run_stream(Engine(Pipeline(*models, backend="cpu"), decode(method), 2))
    max_len = engine.runner.spec.max_len
    assert read == bound and len(set(read)) > 3 and min(read) < max_len // 2 and max(read) <= max_len
    assert engine.runner.take_attended() == max_len  # a bound holds for its step only


@pytest.mark.parametrize("fused", [False, True], ids=["per-module", "fused"])
def test_a_bound_one_slot_short_changes_the_tokens(models, fused):
    """The check above can fail: a verify that misses one slot a running row attends (its newest node) reads
    other attention, and the sampled tokens move."""
    engine, _ = graph_engine(models, "ar", fused)
    exact = engine._attention_bound
    engine._attention_bound = lambda busy: exact(busy) - 1
    assert run_stream(engine) != run_stream(Engine(Pipeline(*models, backend="cpu"), decode("ar"), 2))


def test_the_calibration_floor_widens_the_bound(models):
    """Calibration times an image's first steps at its middle's width (Runner.attend_at_least)."""
    engine, _ = graph_engine(models, "ar", fused=False)
    read = reads(engine, fused=False)
    floor = engine.runner.spec.max_len - 2
    with engine.runner.attend_at_least(floor):
        run_stream(engine)
    assert min(read) == floor


def test_the_spare_slot_is_never_written_and_direct_calls_read_the_whole_cache(models):
    """The graph runner's cache has one slot past max_len (kv_cache.StaticKVCache's `spare`), so a step's
    length is always a proper prefix of it; no step writes there. A verify called outside an engine (profiles,
    conformance) has no bound: it reads every slot."""
    engine, _ = graph_engine(models, "mc-sjd", fused=False)
    runner, spec = engine.runner, engine.runner.spec
    cache = runner.target_cache
    assert cache.max_len == spec.max_len + 1
    run_stream(engine)
    rows = cache.k0.view(cache.batch, cache.n_kv_head, cache.max_len, -1)
    assert rows[:, :, : spec.max_len].abs().sum() > 0 and not rows[:, :, spec.max_len:].any()
    read = reads(engine, fused=False)
    from lantern.backends.base import dummy_step_inputs
    runner.verify(*dummy_step_inputs(spec, spec.verify_widths[0], runner.device))
    assert read == [spec.max_len]
    assert Pipeline(*models, backend="cpu").runner(decode("ar"), 2).target_cache.max_len == spec.max_len
