"""The fused step (lantern.engine.fused): the engine's whole decode step as one graph on graph backends.

For every kind of proposer (AR, a static tree, EAGLE-2's dynamic tree, a Jacobi window with a relaxed rule; a
chain in the functionalized test; SJD and MC-SJD share the Jacobi proposer and its step code): the step
compiles whole (fullgraph: a graph break is an error, and dynamo's break counter stays empty), once per runner
(a second engine on the runner compiles nothing), never recompiles over streams with refills, and gives the eager
cpu backend's tokens, greedy and sampled, at the same seeds. Most tests compile with dynamo's "eager" backend
through a CompileCounter (capture, guards and recompiles are dynamo's either way); one runs aot_eager, which
functionalizes the in-place KV cache and state writes as inductor does. The CUDA-graph and HPU-graph wrappers are
tested against FAKES (labelled so below): no GPU or Gaudi here.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from conftest import make_models
from host_transfers import HostTransfers
from lantern.api import Pipeline
from lantern.models.config import GPTConfig
from lantern.backends import get_backend
from lantern.backends.torch_graph import CUDAGraphReplay
from lantern.decoding import SamplingConfig, method_preset
from lantern.engine import Engine, Request
from lantern.engine.step import static_spec

TREE = [[0], [1], [0, 0], [0, 1], [1, 0]]  # 6 nodes, depth 2: every path of the tree code, few drafter levels
CHAIN = [[0], [0, 0]]
METHODS = {"ar": ("ar", {}), "static-tree": ("lantern++", dict(k=8, drafting=TREE)),
           "chain": ("lantern++", dict(k=8, drafting=CHAIN)),
           "dynamic-tree": ("eagle2", dict(dynamic_depth=3, dynamic_top_k=3, dynamic_total=10)),
           "mc-sjd-relaxed": ("mc-sjd-relaxed", dict(window=4, k=8)),
           "mc-sjd-pac": ("mc-sjd-pac", dict(window=4, branching=2, branch_depth=2, tail=1)),
           "mc-sjd-pac fan": ("mc-sjd-pac", dict(window=4, branching=2, branch_depth=1, fan=6))}  # past top-k 20
STREAM = ((0, 16), (1, 5), (2, 9), (3, 16))  # (class, tokens): images finish at different steps, slots refill


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """conftest's tiny models with one layer (tracing the whole step costs per layer), and tree files."""
    folder = tmp_path_factory.mktemp("trees")
    for name, paths in (("tree", TREE), ("chain", CHAIN)):
        (folder / f"{name}.json").write_text(json.dumps(paths))
    cfg = GPTConfig(dim=64, n_layer=1, n_head=4, vocab_size=64, num_classes=4, block_size=16, multiple_of=32)
    return make_models(cfg), folder


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def decode(method: str, greedy: bool, trees=None):
    """trees: the folder of the tree files (methods drafting a static tree)."""
    name, params = METHODS[method]
    if isinstance(params.get("drafting"), list):
        params = {**params, "drafting": str(trees / ("tree.json" if params["drafting"] is TREE else "chain.json"))}
    return method_preset(name, SamplingConfig(greedy=greedy, cfg_scale=2.0, top_k=20), **params)


def run_stream(engine: Engine) -> list:
    for c, t in STREAM:
        engine.submit(Request(c, seed=10 + c, tokens=t))
    results = engine.run()
    return sorted((r.request_id, r.tokens.tolist()) for r in results)


@pytest.mark.parametrize("method", ["ar", "static-tree", "dynamic-tree", "mc-sjd-relaxed", "mc-sjd-pac",
                                    "mc-sjd-pac fan"])
def test_every_method_fuses_into_one_graph_and_never_recompiles(small, method):
    models, trees = small
    counter = CompileCounterWithBackend("eager")
    fused = Pipeline(*models, backend="cpu-graph", compiler=counter, fused_step=True)
    eager = Pipeline(*models, backend="cpu")
    greedy, sampled = decode(method, True, trees), decode(method, False, trees)
    first = Engine(fused, greedy, 2)
    runner = first.runner
    assert runner.fused and runner.profile()["step"] == "fused step"
    assert runner.graph_keys() == ["prefill", "step"] and counter.frame_count == 1  # warm-up: the prefill only
    got = run_stream(first)
    assert counter.frame_count == 2 and runner.fused_warmup_seconds > 0  # the step: one graph, compiled once
    assert got == run_stream(Engine(eager, greedy, 2))
    with torch.compiler.set_stance("fail_on_recompile"):  # a second engine (a new config object, as each
        assert run_stream(Engine(fused, decode(method, True, trees), 2)) == got  # generate call makes): no compile
    again = Engine(fused, sampled, 2)  # sampling is a different step function: its own graph, once
    got = run_stream(again)
    assert counter.frame_count == 3 and got == run_stream(Engine(eager, sampled, 2))
    with torch.compiler.set_stance("fail_on_recompile"):
        assert run_stream(Engine(fused, decode(method, False, trees), 2)) == got
    assert not counters["graph_break"]  # fullgraph makes a break an error; dynamo saw none either


def test_warm_up_compiles_the_fused_step_before_any_request_and_changes_no_tokens(small):
    """A service warms each engine before it reports ready: after Engine.warm_up the step is compiled (a request
    compiles nothing), the engine is idle and has counted no step, and requests get eager's tokens."""
    models, _ = small
    counter = CompileCounterWithBackend("eager")
    fused = Pipeline(*models, backend="cpu-graph", compiler=counter, fused_step=True)
    engine = Engine(fused, decode("ar", True), 2)
    engine.warm_up()
    assert counter.frame_count == 2 and engine.runner.fused_warm(engine.decode)  # prefill and the step
    assert (engine.busy, engine.waiting, engine.steps_run) == (0, 0, 0)
    with torch.compiler.set_stance("fail_on_recompile"):
        got = run_stream(engine)
    assert got == run_stream(Engine(Pipeline(*models, backend="cpu"), decode("ar", True), 2))
    plain = Engine(Pipeline(*models, backend="cpu"), decode("ar", True), 2)
    plain.warm_up()  # no fused step: nothing to do
    assert (plain.steps_run, plain.busy) == (0, 0)


def test_functionalized_step_matches_eager_and_keeps_its_buffers(small):
    """aot_eager functionalizes the step's in-place writes (KV caches, slot state, records) as inductor does:
    the tokens stay eager's, and the caches and the engine's state buffers are written where they live."""
    (models, trees), dcfg = small, decode("chain", False, small[1])
    fused = Pipeline(*models, backend="cpu-graph", compiler="aot_eager", fused_step=True)
    engine = Engine(fused, dcfg, 2)
    cache = engine.runner.target_cache.k0
    where = cache.data_ptr()
    got = run_stream(engine)
    assert cache.data_ptr() == where and cache.abs().sum() > 0
    assert engine.slots.root is engine._fused._buffers[0]  # the state the step replaced went back in place
    assert got == run_stream(Engine(Pipeline(*models, backend="cpu"), dcfg, 2))


def test_each_fused_step_moves_only_its_report_to_the_host(small):
    """The host-sync budget of tests/decoding/test_speculative.py, kept: inside the graph nothing can read the host
    (fullgraph would fail), and around it each step reads its report once (O(B * depth) elements), plus each
    finishing image's tokens and records once."""
    engine = Engine(Pipeline(*small[0], backend="cpu-graph", compiler="eager", fused_step=True),
                    decode("mc-sjd-relaxed", False), 2)
    for c, t in STREAM:
        engine.submit(Request(c, seed=c, tokens=t))
    per_step = []
    while engine.busy or engine.waiting:
        with HostTransfers() as moved:
            finished = len(engine.step().finished)
        per_step.append((moved.calls, moved.elements, finished))
    assert len(per_step) > 4 and engine._fused.calls == len(per_step)
    report = 4 + engine.proposer.depth + 2 * engine.width  # counters, then each slot's completion and root
    assert all(calls == 1 + (finished > 0) for calls, _, finished in per_step)
    assert all(elements == report for _, elements, finished in per_step if not finished)


def step_graph_ops(models, dcfg) -> Counter:
    """The torch functions and tensor methods the fused step's one graph calls, by name, as dynamo traced it."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    run_stream(Engine(Pipeline(*models, backend="cpu-graph", compiler=keep, fused_step=True), dcfg, 2))
    assert len(graphs) == 2  # the prefill's, then the step's
    return Counter(getattr(node.target, "__name__", str(node.target)) for node in graphs[1].graph.nodes
                   if node.op in ("call_function", "call_method"))


def test_the_jacobi_step_launches_no_sort_scan_or_per_record_store(small):
    """What a GPU step costs beyond its forward is mostly its launches (tools/bench_step_kernels.py). MC-SJD's step
    at a narrow support (top-k 5) finds tokens in it by comparison (no sort, no search), the accepted prefix by a
    reduction (no scan), puts all of the window's prior in a pointwise select, and writes a step's records with one
    indexed store."""
    ops = step_graph_ops(small[0], method_preset("mc-sjd", SamplingConfig(cfg_scale=2.0, top_k=5), window=4))
    assert not {"sort", "argsort", "searchsorted", "cumprod", "cumsum"} & set(ops), ops
    assert ops["setitem"] == 1, ops


def test_a_fused_step_is_the_default_off_and_text_to_image_says_why_not(small):
    models = small[0]
    runner = Pipeline(*models, backend="cpu-graph", compiler="eager").runner(decode("ar", True), 1)
    assert not runner.fused and runner.profile()["step"] == "per-module graphs"
    from lantern.backends.torch_graph import fusable
    t2i = type("Target", (), {"config": type("Config", (), {"model_type": "t2i"})()})()
    assert "caption mask" in fusable(runner.spec, t2i) and fusable(runner.spec, models[0]) is None


class FakeCUDA:
    """A FAKE of the torch.cuda graph API that CUDAGraphReplay calls: streams, CUDAGraph, graph(). It runs on
    the CPU and records what happens; a 'recording' runs its body once (a real recording runs nothing: the
    replay right after it does), so it counts that replay as the recorded body's own run."""

    def __init__(self):
        self.events = []

    class Stream:
        def wait_stream(self, other):
            pass

    def current_stream(self):
        return self.Stream()

    def stream(self, s):
        fake = self

        class Ctx:
            def __enter__(self):
                fake.events.append("side-stream")

            def __exit__(self, *exc):
                return False
        return Ctx()

    def CUDAGraph(self):
        fake = self

        class Graph:
            def replay(self):
                fake.events.append("replay")
        self.events.append("new-graph")
        return Graph()

    def graph(self, g):
        fake = self

        class Ctx:
            def __enter__(self):
                fake.events.append("record")

            def __exit__(self, *exc):
                return False
        return Ctx()


def test_cuda_graph_replay_records_the_step_once_on_a_fake_cuda():
    """FAKE torch.cuda: the step function runs on a side stream for its warm calls, is recorded once, then only
    replayed, and every replay hands back the recorded report tensor."""
    fake, calls = FakeCUDA(), []

    def step():
        calls.append(1)
        return torch.tensor([len(calls)])
    replay = CUDAGraphReplay(step, cuda=fake)
    reports = [replay() for _ in range(7)]
    warm = CUDAGraphReplay.WARM_CALLS
    assert len(calls) == warm + 1 and fake.events[:warm + 2] == ["side-stream"] * warm + ["new-graph", "record"]
    assert fake.events.count("replay") == 7 - warm and fake.events.count("new-graph") == 1
    assert all(r is reports[warm] for r in reports[warm:])


@pytest.mark.parametrize("changes_at", [2, 3])
def test_a_step_that_would_recompile_fails_before_its_capture_on_a_fake_cuda(changes_at):
    """FAKE torch.cuda around a real torch.compile (dynamo's eager backend): a step whose guard fails on its
    second or third call must fail on a warm call, under the fail-on-recompile stance, never recompile inside
    the recording (on a GPU a hard error of torch.cuda.graph)."""
    fake, state = FakeCUDA(), {"calls": 0}
    scale = {"value": 1}

    def body(x):
        return x * scale["value"]  # dynamo guards on the dict's value: a change recompiles
    compiled = torch.compile(body, backend="eager", fullgraph=True)

    def step():
        state["calls"] += 1
        if state["calls"] == changes_at:
            scale["value"] = 2
        return compiled(torch.ones(2))
    torch._dynamo.reset()
    replay = CUDAGraphReplay(step, cuda=fake)
    with pytest.raises(RuntimeError, match="recompile"):
        for _ in range(changes_at):
            replay()
    assert "record" not in fake.events


def test_cuda_graph_runner_wraps_its_fused_step_in_one_recording(small, monkeypatch):
    """The cuda-graph runner's fused step (a CompiledRunner with mode reduce-overhead, here on the CPU with
    dynamo's eager backend): compiled without reduce-overhead, replayed through CUDAGraphReplay."""
    from lantern.backends import torch_graph
    target = small[0][0]
    spec = static_spec(decode("ar", True), target.config, 1, "fp32")
    runner = torch_graph.CompiledRunner(target, None, spec, torch.device("cpu"), compiler="eager",
                                        mode="reduce-overhead", fused=True)
    assert isinstance(runner.replayable(lambda: torch.zeros(1)), CUDAGraphReplay)
    assert runner.capture_step(len) is runner.capture_step(len)  # compiled once per runner and function


def test_hpu_fused_step_is_one_hpu_graph_per_engine_on_the_fake_bridge(small, monkeypatch):
    """FAKE habana_frameworks (tests/fakes): with fused_step the whole step is one wrap_in_hpu_graph module,
    captured once per engine under one key (no tensor arguments), replayed after, each call followed by
    mark_step; tokens equal eager cpu's, greedy and sampled."""
    from fakes.fake_habana_frameworks import install, uninstall
    from lantern.backends import hpu as hpu_backend
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    monkeypatch.delenv("LANTERN_GAUDI_CONFIG", raising=False)
    fake = install(monkeypatch)
    monkeypatch.setattr(hpu_backend, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(hpu_backend, "gaudi_devices", lambda: ["accel0"])
    try:
        pipe = Pipeline(*small[0], backend="hpu", dtype="fp32", fused_step=True)
        eager = Pipeline(*small[0], backend="cpu")
        for greedy in (True, False):
            dcfg = decode("mc-sjd-relaxed", greedy)
            engine = Engine(pipe, dcfg, 2)
            assert engine.runner.fused and engine.runner.graph_keys() == ["prefill", "step"]
            before = len(fake.events)
            assert run_stream(engine) == run_stream(Engine(eager, dcfg, 2))
            whole = [label for label in fake.wrapped if label.startswith("WholeStep")][-1]
            assert len(fake.keys[whole]) == 1
            events = [e for e in fake.events[before:] if e == ("mark_step",) or e[1:] == (whole,)]
            graph_calls = [i for i, e in enumerate(events) if len(e) == 2]
            assert [events[i][0] for i in graph_calls].count("capture") == 1 and len(graph_calls) > 3
            assert all(events[i + 1] == ("mark_step",) for i in graph_calls)
        assert not any(label.startswith(("TargetStep", "DraftStep", "CacheCommit")) and fake.keys[label]
                       for label in fake.wrapped)  # fused: the per-module step graphs are never captured
    finally:
        uninstall()


def test_each_configuration_on_a_runner_compiles_its_own_step_before_it_counts_as_prepared(small):
    """Two configurations of one static shape share a runner but not a step graph (the acceptance rule is part of
    it): the runner is prepared for the one whose step compiled, not for the other, and compile_fused_step
    compiles the other's before any timed run (else a calibration times that compile as steps)."""
    from lantern.plan import calibration
    models, _ = small
    counter = CompileCounterWithBackend("eager")
    pipe = Pipeline(*models, backend="cpu-graph", compiler=counter, fused_step=True)
    relaxed = decode("mc-sjd-relaxed", False)
    exact = method_preset("mc-sjd", relaxed.sampling, window=4)
    assert pipe.spec(relaxed, 2) == pipe.spec(exact, 2)  # one runner
    calibration.compile_fused_step(pipe, relaxed, 2)
    assert pipe.prepared(relaxed, 2) and not pipe.prepared(exact, 2)
    frames = counter.frame_count
    calibration.compile_fused_step(pipe, exact, 2)
    assert counter.frame_count > frames and pipe.prepared(exact, 2)
    with torch.compiler.set_stance("fail_on_recompile"):
        for dcfg in (relaxed, exact):
            run_stream(Engine(pipe, dcfg, 2))
