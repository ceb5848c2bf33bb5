"""The step engine: every method's greedy tokens as the per-method loops gave them (golden file), per-request
determinism under continuous batching on cpu, cpu-graph and onnx, lossless sampling with refills (and broken
refills caught), a thread-safe Pipeline, zero recompiles, per-step reports and per-request stats."""
import json
import random
import threading

import pytest
import torch
from scipy.stats import kstest
from torch._dynamo.testing import CompileCounterWithBackend

import lantern.engine.step as step_module
from conftest import make_models
from lantern.api import Pipeline
from lantern.models.config import gpt_preset
from lantern.decoding import SamplingConfig, method_preset
from lantern.engine import Engine, Request, SamplingOverrides, derive_seed
from lantern.engine.draws import SlotDraws
from make_greedy_golden import CFG_SCALES, GOLDEN, METHODS, golden_config
from test_backend_onnx import needs_ort
from test_speculative import LEVEL, SAMPLING, ar_distribution, flat_micro, pvalues

SAMPLED = {"ar": {}, "lantern++": dict(k=8), "eagle2": dict(dynamic_depth=3, dynamic_top_k=3, dynamic_total=10),
           "mc-sjd": dict(window=4), "mc-sjd-pac": dict(window=4, branching=3, branch_depth=2, tail=1)}


@pytest.fixture(scope="module")
def pipe():
    return Pipeline(*make_models(gpt_preset("GPT-test")), backend="cpu")


def run(engine: Engine, requests, order=None) -> dict:
    """Submit `requests` (in `order`), step until done -> request_id -> tokens as a list."""
    for i in order or range(len(requests)):
        engine.submit(requests[i])
    return {r.request_id: r.tokens.tolist() for r in engine.run()}


# --- greedy: the tokens of the loops the engine replaced ----------------------------------------------------

@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_tokens_equal_the_per_method_loops(pipe, method):
    """B = 1 (with CFG) and B = 3 (without), 6 images: slots refill as images finish, mid-flight (Jacobi and
    trees finish at different steps); every image equals the golden file's."""
    golden = json.loads(GOLDEN.read_text())
    classes = [2, 0, 3, 1, 1, 2]
    for scale, width in zip(sorted(CFG_SCALES, reverse=True), (1, 3)):
        tokens = pipe.generate(classes, golden_config(method, scale), seed=0, batch=width).tokens
        for c, row in zip(classes, tokens):
            assert row.tolist() == golden[f"{method} cfg={scale}"][str(c)], (scale, width, c)


# --- per-request determinism ---------------------------------------------------------------------------------

def same_alone_and_among_others(pipe, method: str, width: int = 3, trials: int = 2) -> None:
    """A sampled request (class 1, its own seed) alone, then among random other requests in random arrival
    orders: the same tokens every time, whichever slot it lands in and whenever."""
    dcfg = method_preset(method, SamplingConfig(cfg_scale=2.0, top_k=20), **SAMPLED[method])
    mine = Request(1, seed=4242, request_id="mine")
    alone = run(Engine(pipe, dcfg, width), [mine])["mine"]
    rng = random.Random(method)
    for _ in range(trials):
        others = [Request(rng.randrange(4), seed=rng.randrange(2 ** 40), request_id=f"o{i}")
                  for i in range(rng.randrange(2, 7))]
        everyone = others + [mine]
        order = list(range(len(everyone)))
        rng.shuffle(order)
        assert run(Engine(pipe, dcfg, width), everyone, order)["mine"] == alone


@pytest.mark.parametrize("method", list(SAMPLED))
def test_a_request_draws_the_same_alone_and_among_others_on_cpu(pipe, method):
    same_alone_and_among_others(pipe, method)


@pytest.mark.parametrize("method", ["lantern++", "mc-sjd", "mc-sjd-pac"])
def test_a_request_draws_the_same_alone_and_among_others_on_cpu_graph(method):
    same_alone_and_among_others(Pipeline(*make_models(gpt_preset("GPT-test")), backend="cpu-graph",
                                         compiler="eager"), method, trials=2)


@needs_ort
def test_a_request_draws_the_same_alone_and_among_others_on_onnx(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("LANTERN_ONNX_CACHE", str(tmp_path_factory.getbasetemp() / "engine-onnx-cache"))
    same_alone_and_among_others(Pipeline(*make_models(gpt_preset("GPT-test")), backend="onnx", threads=1),
                                "lantern++", trials=2)


def test_a_refill_that_keeps_the_slots_random_stream_is_caught(pipe, monkeypatch):
    """Broken: a new request goes on with its slot's previous stream (seed and counter not reset)."""
    monkeypatch.setattr(SlotDraws, "admit", lambda self, slots, seeds: None)
    with pytest.raises(AssertionError):
        same_alone_and_among_others(pipe, "lantern++")


@pytest.mark.parametrize("method", ["lantern++", "mc-sjd"])
def test_a_requests_own_temperature_and_cfg_scale_are_what_an_engine_set_to_them_gives(pipe, method):
    """Per-request temperature and CFG scale among requests with other settings: the same tokens as the
    request alone in an engine whose own settings are those (where the lossless tests hold)."""
    base = SamplingConfig(cfg_scale=2.0, top_k=20)
    mine = SamplingConfig(cfg_scale=3.5, top_k=20, temperature=0.7)
    own = Engine(pipe, method_preset(method, mine, **SAMPLED[method]), 3)
    alone = run(own, [Request(1, seed=99, request_id="mine")])["mine"]
    shared = Engine(pipe, method_preset(method, base, **SAMPLED[method]), 3)
    others = [Request(c, seed=c, request_id=f"o{c}", sampling=SamplingOverrides(temperature=1.0 + c / 4))
              for c in range(4)]
    mixed = run(shared, others + [Request(1, seed=99, request_id="mine",
                                          sampling=SamplingOverrides(temperature=0.7, cfg_scale=3.5))])
    assert mixed["mine"] == alone
    assert run(Engine(pipe, method_preset(method, base, **SAMPLED[method]), 3),
               [Request(1, seed=99, request_id="mine")])["mine"] != alone


def test_image_i_of_a_call_is_reproduced_alone_with_its_derived_seed(pipe):
    dcfg = method_preset("lantern++", SamplingConfig(cfg_scale=2.0), k=8)
    batch = pipe.generate([0, 3, 2, 1], dcfg, seed=11, batch=2).tokens
    for i, c in enumerate([0, 3, 2, 1]):
        assert torch.equal(pipe.generate([c], dcfg, seed=derive_seed(11, i)).tokens[0], batch[i])
    assert derive_seed(11, 0) == 11 and len({derive_seed(11, i) for i in range(100)}) == 100


def test_the_streams_are_uniform_and_independent():
    """Per-slot uniforms (Kolmogorov-Smirnov), across seeds, steps and draws of a step; and a slot's numbers
    do not depend on the batch width or the slot."""
    wide, narrow = SlotDraws(4, "cpu"), SlotDraws(1, "cpu")
    wide.admit(torch.arange(4), torch.tensor([7, 8, 2 ** 40 + 7, 9]))
    narrow.admit(torch.arange(1), torch.tensor([2 ** 40 + 7]))
    wide.begin(torch.ones(4, dtype=torch.bool))
    narrow.begin(torch.ones(1, dtype=torch.bool))
    first, second = wide.uniform((4, 50000)), wide.uniform((4, 50000))
    assert torch.equal(narrow.uniform((1, 50000))[0], first[2])
    for u in (first[0], first[2], second[0]):
        assert kstest(u.double().numpy(), "uniform").pvalue > 1e-3
        assert 0 < float(u.min()) and float(u.max()) < 1
    pairs = torch.stack([first[0], first[1], first[2], second[0]])
    assert (torch.corrcoef(pairs) - torch.eye(4)).abs().max() < 0.03


# --- lossless with refills -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    target, drafter = flat_micro()
    expected = {c: ar_distribution(target, c, SAMPLING) for c in range(3)}
    tree = tmp_path_factory.mktemp("tree") / "tree.json"  # sampled drafts, siblings, depth 3
    tree.write_text(json.dumps([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]))
    return Pipeline(target, drafter, None, backend="cpu"), expected, str(tree)


def lossless_pvalues(flat, drafting: str, per_class: int = 1500, **options) -> list:
    """3 x per_class images through 300 slots: slots refill at every step (images finish at different steps)."""
    pipe, expected, tree = flat
    classes = [0, 1, 2] * per_class
    random.Random(0).shuffle(classes)
    dcfg = method_preset("eagle2", SAMPLING, drafting=tree if drafting == "tree" else drafting, **options)
    tokens = pipe.generate(classes, dcfg, seed=0, batch=300).tokens
    weights = torch.tensor([6 ** 3, 6 ** 2, 6, 1])
    out = []
    for c in range(3):
        counts = torch.bincount((tokens[torch.tensor(classes) == c] * weights).sum(1), minlength=6 ** 4).float()
        out += pvalues(counts, expected[c])
    return out


@pytest.mark.parametrize("drafting, options", [("tree", {}), ("jacobi", dict(window=2))])
def test_sampling_through_the_engine_with_refills_reproduces_ar(flat, drafting, options):
    assert min(lossless_pvalues(flat, drafting, **options)) > LEVEL


def test_a_refill_that_keeps_the_previous_images_prefix_fails_the_lossless_test(flat, monkeypatch):
    """Broken: a refilled slot's prefix (its KV rows and the first logits) stays the slot's first image's."""
    real = step_module.condition_rows
    first = {}

    def stale_rows(cond, dcfg, null):
        first.setdefault("cond", cond.clone())
        return real(first["cond"], dcfg, null)
    monkeypatch.setattr(step_module, "condition_rows", stale_rows)
    assert min(lossless_pvalues(flat, "tree", per_class=500)) < LEVEL


# --- threads, graphs, host transfers ---------------------------------------------------------------------

def test_two_threads_on_one_pipeline_get_what_they_get_one_after_another(pipe):
    jobs = [([0, 1, 2], method_preset("lantern++", SamplingConfig(cfg_scale=2.0), k=8), 5),
            ([3, 2, 1], method_preset("mc-sjd", SamplingConfig(cfg_scale=2.0), window=4), 6),
            ([1, 1, 0], method_preset("ar", SamplingConfig(cfg_scale=2.0)), 7)]
    alone = [pipe.generate(c, d, seed=s, batch=2).tokens for c, d, s in jobs]
    together = [None] * len(jobs)

    def worker(i):
        c, d, s = jobs[i]
        together[i] = pipe.generate(c, d, seed=s, batch=2).tokens
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


@pytest.mark.parametrize("method", ["lantern++", "mc-sjd"])
def test_a_stream_with_refills_never_recompiles(method):
    counter = CompileCounterWithBackend("eager")
    pipe = Pipeline(*make_models(gpt_preset("GPT-test")), backend="cpu-graph", compiler=counter)
    dcfg = method_preset(method, SamplingConfig(cfg_scale=2.0, top_k=20), **SAMPLED[method])
    engine = Engine(pipe, dcfg, 2)
    compiled = counter.frame_count
    with torch.compiler.set_stance("fail_on_recompile"):
        run(engine, [Request(c, seed=c, tokens=t) for c, t in ((0, 16), (1, 5), (2, 16), (3, 9), (1, 16))])
    assert counter.frame_count == compiled == len(engine.runner.profile()["graphs"])


# --- reports, stats, requests --------------------------------------------------------------------------------

def test_step_reports_add_up_to_the_requests_stats(pipe):
    dcfg = method_preset("lantern++", SamplingConfig(cfg_scale=2.0), k=8)
    engine = Engine(pipe, dcfg, 2)
    for c in (0, 1, 2):
        engine.submit(Request(c, seed=c))
    reports, results = [], []
    while engine.waiting or engine.busy:
        reports.append(engine.step())
        results += reports[-1].finished
    assert [r.slots_busy for r in reports][0] == 2 and len(results) == 3
    drafts = [len(img.accepted_lengths) for r in results for img in r.stats.images]
    accepted = sum(x - 1 for r in results for x in r.stats.accepted_lengths)
    assert sum(r.accepted_tokens for r in reports) == accepted
    assert sum(r.drafts for r in reports) <= sum(drafts) and sum(r.draft_tokens for r in reports) > 0
    assert sum(r.accepted_per_position[0] for r in reports) == sum(
        1 for r in results for x in r.stats.accepted_lengths if x > 1)
    for r in results:
        assert r.submitted_s <= r.started_s <= r.finished_s and r.tokens.shape == (pipe.config.block_size,)
        (img,) = r.stats.images
        assert sum(img.accepted_lengths) + 1 == img.tokens == 16


def test_cancel_drops_a_queued_request_and_frees_a_running_one(pipe):
    engine = Engine(pipe, method_preset("ar", SamplingConfig()), 1)
    first, second = engine.submit(Request(0, seed=1)), engine.submit(Request(1, seed=2))
    engine.step()
    assert engine.cancel(second) and engine.cancel(first) and not engine.cancel("nobody")
    report = engine.step()
    assert {r.request_id: r.cancelled for r in report.finished} == {first: True, second: True}
    assert engine.busy == 0 and engine.waiting == 0
    assert [len(r.tokens) for r in report.finished if r.request_id == first] == [2]


def test_requests_are_checked_before_they_queue(pipe):
    engine = Engine(pipe, method_preset("ar", SamplingConfig(top_k=5)), 2)
    with pytest.raises(ValueError, match=r"class id 9 is out of range; allowed: integers 0..3"):
        engine.submit(Request(9, seed=0))
    with pytest.raises(ValueError, match=rf"seed -1 is not allowed; allowed: an integer in \[0, {2 ** 63 - 1}\]"):
        engine.submit(Request(0, seed=-1))
    with pytest.raises(ValueError, match=r"tokens 17 must be an integer in 1..16"):
        engine.submit(Request(0, seed=0, tokens=17))
    with pytest.raises(ValueError, match=r"sampling top_k=7 differs from this engine's 5; per request only "
                                         r"temperature and cfg_scale may differ"):
        engine.submit(Request(0, seed=0, sampling=SamplingOverrides(top_k=7)))
    with pytest.raises(ValueError, match=r"cfg_scale=2.0: this engine runs without CFG"):
        engine.submit(Request(0, seed=0, sampling=SamplingOverrides(cfg_scale=2.0)))
    with pytest.raises(ValueError, match=r"temperature 0.0 must be > 0"):
        engine.submit(Request(0, seed=0, sampling=SamplingOverrides(temperature=0.0)))
    engine.submit(Request(0, seed=0, request_id="a", sampling=SamplingOverrides(top_k=5)))
    with pytest.raises(ValueError, match=r"request_id 'a' is already queued or running"):
        engine.submit(Request(1, seed=0, request_id="a"))
    assert engine.waiting == 1


def test_a_second_engine_cannot_take_a_runner_with_requests_in_flight(pipe):
    dcfg = method_preset("ar", SamplingConfig())
    first, second = Engine(pipe, dcfg, 2), Engine(pipe, dcfg, 2)
    first.submit(Request(0, seed=0))
    first.step()
    second.submit(Request(1, seed=1))
    with pytest.raises(RuntimeError, match="another engine has 1 requests in flight on this runner"):
        second.step()
    first.run()
    assert len(second.run()) == 1


def test_caption_conditions_run_through_the_engine():
    """t2i: a request's condition is one caption embedding (P, C); sampled with CFG, each image alone equals
    the same image among others (the prefix of 3 caption tokens is refilled per slot)."""
    from lantern.models.config import GPTConfig
    from lantern.models.gpt import GPT
    cfg = GPTConfig(dim=32, n_layer=1, n_head=2, vocab_size=16, model_type="t2i", caption_dim=12, cls_token_num=3,
                    block_size=9, multiple_of=16)
    torch.manual_seed(0)
    pipe = Pipeline(GPT(cfg).eval(), None, None, backend="cpu")
    captions = torch.randn(4, 3, 12)
    dcfg = method_preset("mc-sjd", SamplingConfig(cfg_scale=2.0), window=3)
    together = pipe.generate(captions, dcfg, seed=3, batch=2).tokens
    for i in range(4):
        assert torch.equal(pipe.generate(captions[i:i + 1], dcfg, seed=derive_seed(3, i)).tokens[0], together[i])
    with pytest.raises(ValueError, match=r"t2i conditions must be caption embeddings of shape \(n, 3, 12\)"):
        Engine(pipe, dcfg, 2).submit(Request(torch.zeros(3, 5), seed=0))
