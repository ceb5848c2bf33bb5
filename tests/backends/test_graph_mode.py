"""Graph mode (cpu-graph) against the eager reference: same logits and token ids, one compile per static
step, and no recompile over whole generations (AR and speculative, every acceptance rule, two classes).

Most tests compile with dynamo's cheap "eager"/"aot_eager" backends through a CompileCounter (a real inductor
compile takes seconds here); capture, guards and recompiles are dynamo's either way. One test runs inductor.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from lantern.api import Pipeline
from lantern.backends import StaticSpec, get_backend
from lantern.decoding import SamplingConfig, method_preset
from lantern.engine import Engine, Request
from lantern.engine.step import static_spec

TREE_PARENTS = (-1, 0, 0, 1, 1, 2)  # a 6-node tree: root, 2 children, 3 grandchildren
TREE_DEPTH = (0, 1, 1, 2, 2, 2)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def models(tiny):
    """conftest's tiny target (peaked, so trees get accepted) and drafter."""
    return tiny[0], tiny[1]


def spec_for(cfg, speculative: bool, dtype: str = "fp32") -> StaticSpec:
    n = len(TREE_PARENTS)
    return StaticSpec(batch=2, max_len=cfg.seq_len + n, prefix_len=cfg.cls_token_num,
                      verify_widths=(1, n) if speculative else (1,),
                      draft_widths=(1, 4) if speculative else (), dtype=dtype, commit_width=3)


def tree_mask(n: int) -> torch.Tensor:
    """(n, n) bool: node i attends to j iff j is i or an ancestor of i."""
    m = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        j = TREE_PARENTS[i]
        while j >= 0:
            m[i, j] = True
            j = TREE_PARENTS[j]
    return m


def step_inputs(spec: StaticSpec, pos: int, width: int, tokens: torch.Tensor, tree: bool):
    """Inputs of a step of `width` tokens whose first token sits at sequence position / slot `pos`."""
    b, s = spec.batch, spec.max_len
    depth = torch.tensor(TREE_DEPTH[:width]) if tree else torch.arange(width)
    positions = (pos + depth).expand(b, width).contiguous()
    slots = (pos + torch.arange(width)).expand(b, width).contiguous()
    mask = torch.zeros(b, width, s, dtype=torch.bool)
    mask[:, :, :pos] = True  # the committed prefix
    local = tree_mask(width) if tree else torch.ones(width, width, dtype=torch.bool).tril()
    mask[:, :, pos:pos + width] = local
    return tokens, positions, slots, mask


def step_loop(runner, rounds: int = 3, seed: int = 0) -> list[torch.Tensor]:
    """What a generation does to a runner: prefill, AR steps, tree verify + commit of an accepted path, drafter
    steps; every output collected for parity checks."""
    spec, cfg = runner.spec, runner.model_config
    g = torch.Generator().manual_seed(seed)
    b, p, s = spec.batch, spec.prefix_len, spec.max_len
    pmask = (torch.arange(s)[None, None, :] <= torch.arange(p)[None, :, None]).expand(b, p, s).contiguous()
    cond = torch.tensor([1, cfg.null_class])
    out = runner.prefill(cond, pmask)
    outs, pos = [out.logits, out.hidden], p
    for _ in range(rounds):
        tokens = torch.randint(cfg.vocab_size, (b, 1), generator=g)
        out = runner.verify(*step_inputs(spec, pos, 1, tokens, tree=False))
        outs += [out.logits, out.hidden]
        pos += 1
        for t in spec.verify_widths[1:]:
            tokens = torch.randint(cfg.vocab_size, (b, t), generator=g)
            out = runner.verify(*step_inputs(spec, pos, t, tokens, tree=True))
            outs += [out.logits, out.hidden]
            path = torch.tensor([0, 1, 3])  # root -> node 1 -> node 3 accepted
            runner.commit((pos + path).expand(b, 3), (pos + torch.arange(3)).expand(b, 3))
            pos += 3
        for t in spec.draft_widths:
            tokens = torch.randint(cfg.vocab_size, (b, t), generator=g)
            _, positions, slots, mask = step_inputs(spec, pos - t, t, tokens, tree=False)
            d = runner.draft(tokens, out.hidden[:, :1].expand(b, t, -1).contiguous(), positions, slots, mask)
            outs += [d.logits, d.hidden]
    assert pos + max(spec.verify_widths) <= s
    caches = [runner.target_cache] + ([runner.draft_cache] if runner.drafter is not None else [])
    return outs + [used_slots(c, c.k0, s) for c in caches] + [used_slots(c, c.v0, s) for c in caches]


def used_slots(cache, layer: torch.Tensor, max_len: int) -> torch.Tensor:
    """A layer's K or V cache over the slots steps use, (B, H_kv, max_len, hd), without a bounded runner's spare
    slot."""
    return layer.view(cache.batch, cache.n_kv_head, cache.max_len, -1)[:, :, :max_len].clone()


def prepare(backend: str, models, spec: StaticSpec, **options):
    target, drafter = models
    return get_backend(backend, **options).prepare(target, drafter if spec.draft_widths else None, spec)


RULES = {"exact": {}, "lantern": dict(k=4, delta=0.1), "lantern++": dict(k=4, lam=3.0)}
DRAFTING = {"ar": ("ar", {}), "static-tree": ("lantern++", dict(drafting="eagle1-25")),
            "dynamic-tree": ("eagle2", dict(dynamic_total=16))}


def decode_configs(drafting: str) -> list[tuple[int, object]]:
    """(class, DecodeConfig) pairs on one drafting mode: every acceptance rule (AR has none), each greedy for
    class 0 and sampling for class 1, both with CFG."""
    method, tree = DRAFTING[drafting]
    rules = {"exact": {}} if method == "ar" else RULES
    return [(cls, method_preset(method, SamplingConfig(greedy=cls == 0, cfg_scale=2.0, top_k=16), acceptance=rule,
                                **tree, **params))
            for rule, params in rules.items() for cls in (0, 1)]


def generate(models, runner, dcfg, cls: int, proximity, seed: int = 0) -> torch.Tensor:
    """One image's token ids (block,) for class `cls` through the step engine on `runner` (prepared from
    models = (target, drafter))."""
    engine = Engine(Pipeline(*models, proximity, backend="cpu"), dcfg, 1, runner=runner)
    engine.submit(Request(cls, seed))
    return engine.run()[0].tokens


@pytest.mark.parametrize("drafting", list(DRAFTING))
def test_whole_generations_compile_each_static_step_once(models, tiny, drafting):
    """After warm-up: zero recompiles over every rule, greedy and sampling, two classes; greedy ids == eager."""
    cfg = models[0].config
    configs = decode_configs(drafting)
    spec = static_spec(configs[0][1], cfg, batch=1, dtype="fp32")
    assert all(static_spec(d, cfg, batch=1, dtype="fp32") == spec for _, d in configs)
    counter = CompileCounterWithBackend("eager")
    graph = prepare("cpu-graph", models, spec, compiler=counter)
    eager = prepare("cpu", models, spec)
    assert counter.frame_count == 0  # nothing compiles before warm-up, whose time is reported apart
    graph.warmup()
    keys = graph.profile()["graphs"]
    assert counter.frame_count == len(keys) == len(spec.static_steps)
    proximity = tiny[2]
    with torch.compiler.set_stance("fail_on_recompile"):
        for cls, dcfg in configs:
            ids = generate(models, graph, dcfg, cls, proximity)
            assert ids.shape == (cfg.block_size,)
            if dcfg.sampling.greedy:
                assert torch.equal(ids, generate(models, eager, dcfg, cls, proximity))
    assert counter.frame_count == len(keys)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,compiler", [("fp32", "aot_eager"), ("bf16", "eager")])
def test_every_step_matches_eager(models, dtype, compiler):
    """Logits, features and the KV cache after every kind of step (aot_eager functionalizes the in-place
    cache writes, as inductor does)."""
    spec = spec_for(models[0].config, speculative=True, dtype=dtype)
    eager = prepare("cpu", models, spec)
    eager.trims_attention = False  # the graph's own static shapes: capture must change nothing, bit for bit
    graph = prepare("cpu-graph", models, spec, compiler=compiler)
    graph.warmup()
    eager.warmup()
    for a, b in zip(step_loop(eager, rounds=2), step_loop(graph, rounds=2)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_eager_attention_over_the_live_slots_matches_the_whole_cache(models):
    """Eager on a CPU attends only up to the last slot any row attends (or a floor, as calibration sets): the
    other slots add exactly nothing, so every output is the whole-cache computation's up to float rounding."""
    spec = spec_for(models[0].config, speculative=True)
    trimmed, whole, floored = (prepare("cpu", models, spec) for _ in range(3))  # fresh caches: same outputs
    whole.trims_attention = False
    prefix = torch.zeros(spec.batch, 1, spec.max_len, dtype=torch.bool)
    prefix[..., : spec.prefix_len] = True
    assert trimmed.live_slots(prefix).shape == (spec.batch, 1, spec.prefix_len)
    assert whole.live_slots(prefix).shape == prefix.shape
    floor = spec.prefix_len + spec.max_len // 2
    with floored.attend_at_least(floor):  # what calibration times: a wider floor, same outputs
        assert floored.live_slots(prefix).shape == (spec.batch, 1, floor)
        floored_out = step_loop(floored, rounds=2)
    assert floored.live_slots(prefix).shape == (spec.batch, 1, spec.prefix_len)  # the floor is gone after
    for a, b, c in zip(step_loop(whole, rounds=2), step_loop(trimmed, rounds=2), floored_out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)


def test_pipeline_selects_graph_mode_by_name(tiny):
    """The public API: backend="cpu-graph" with backend options, warmed up before generating (every graph
    compiled in warm-up: generation itself never compiles)."""
    dcfg = method_preset("lantern++", SamplingConfig(greedy=True, cfg_scale=2.0), drafting="eagle1-25", k=4)
    counter = CompileCounterWithBackend("eager")
    pipe = Pipeline(*tiny, backend="cpu-graph", compiler=counter)
    pipe.runner(dcfg, 2)
    compiled_in_warmup = counter.frame_count
    with torch.compiler.set_stance("fail_on_recompile"):
        graph = pipe.generate([0, 1], dcfg)
    eager = Pipeline(*tiny, backend="cpu").generate([0, 1], dcfg)
    assert torch.equal(graph.tokens, eager.tokens)
    assert graph.backend == "cpu-graph" and counter.frame_count == compiled_in_warmup == len(graph.profile["graphs"])
    assert graph.profile["graphs"] == ["prefill", "verify[26]", "draft[5]", "draft[6]", "commit"]


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                    reason="inductor on CPU needs a C++ compiler")
def test_inductor_greedy_ids_match_eager(models):
    """The compiler the benchmark uses, on AR generation only (each inductor compile takes seconds here)."""
    cfg = models[0].config
    dcfg = method_preset("ar", SamplingConfig(greedy=True, cfg_scale=2.0))
    spec = static_spec(dcfg, cfg, batch=1, dtype="fp32")
    eager, graph = prepare("cpu", models, spec), prepare("cpu-graph", models, spec)
    graph.warmup()
    with torch.compiler.set_stance("fail_on_recompile"):
        for cls in (0, 1):
            assert torch.equal(generate(models, graph, dcfg, cls, None), generate(models, eager, dcfg, cls, None))


def test_widths_outside_the_spec_are_refused(models):
    spec = spec_for(models[0].config, speculative=True)
    runner = prepare("cpu-graph", models, spec, compiler="eager")
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"verify width 3 is not one of this runner's static widths \(1, 6\)"):
        runner.verify(*step_inputs(spec, 1, 3, tokens, tree=False))
    with pytest.raises(ValueError, match=r"draft width 3"):
        runner.draft(tokens, torch.zeros(2, 3, 64), *step_inputs(spec, 1, 3, tokens, tree=False)[1:])
    with pytest.raises(ValueError, match=r"commit takes src and dst of shape \(batch, commit_pairs\) = \(2, 3\)"):
        runner.commit(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long))


def test_compiling_runners_leave_the_process_recompile_limit_alone(models):
    """Three runners of other shapes share the step modules' code objects: past a limit of 2 they compile only
    because warm-up raises the limit, and the limit is back where it was afterwards."""
    cfg = models[0].config
    with torch._dynamo.config.patch(cache_size_limit=2):  # dynamo's own patching: its alias survives the test
        for width in (2, 3, 4):
            spec = StaticSpec(batch=2, max_len=cfg.seq_len + 4, prefix_len=cfg.cls_token_num, verify_widths=(width,))
            prepare("cpu-graph", models, spec, compiler="eager").warmup()
            assert torch._dynamo.config.cache_size_limit == 2


@pytest.mark.slow
@pytest.mark.parametrize("drafting", ["eagle1-25", "dynamic"])
def test_images_batched_equal_each_alone(tiny, drafting):
    """Greedy: three images in one static batch give each image's tokens exactly as decoded alone."""
    dcfg = method_preset("eagle2" if drafting == "dynamic" else "lantern++", SamplingConfig(greedy=True, cfg_scale=2.0),
                         **({"dynamic_total": 16} if drafting == "dynamic" else {"drafting": drafting, "k": 4}))
    pipe = Pipeline(*tiny, backend="cpu-graph", compiler="eager")
    together = pipe.generate([0, 1, 2], dcfg, seed=0).tokens
    alone = torch.cat([pipe.generate([c], dcfg, seed=0).tokens for c in (0, 1, 2)])
    assert torch.equal(together, alone)
