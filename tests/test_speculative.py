"""Speculative decoding end to end on the CPU backend, against AR decoding on the same model."""
import itertools
import json

import pytest
import torch
from scipy.stats import chisquare

from lantern.api import Pipeline
from lantern.decoding import TREE_PRESETS, DecodeConfig, SamplingConfig, method_preset

SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def pipe(tiny):
    target, drafter, proximity = tiny
    return Pipeline(target, drafter, proximity, backend="cpu")


@pytest.mark.parametrize("drafting", list(TREE_PRESETS) + ["dynamic"])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_speculative_equals_greedy_ar(pipe, drafting, cfg_scale):
    sc = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    ar = pipe.generate([1, 3], DecodeConfig(sampling=sc), seed=0)
    spec = pipe.generate([1, 3], DecodeConfig(sampling=sc, drafting=drafting, dynamic_total=20), seed=0)
    assert torch.equal(ar.tokens, spec.tokens)
    s = spec.stats.summary()
    assert s["tokens"] == 2 * pipe.config.block_size
    assert s["target_forwards"] == 2 + len(spec.stats.accepted_lengths)  # one prefill per image + verifies
    assert sum(spec.stats.accepted_lengths) + 2 == s["tokens"]  # the prefill's token, then tau per step


def test_same_seed_same_tokens_and_different_seed_differs(pipe):
    dcfg = method_preset("lantern++", SamplingConfig(cfg_scale=2.0))
    a, b = (pipe.generate([0, 2], dcfg, seed=7) for _ in range(2))
    c = pipe.generate([0, 2], dcfg, seed=8)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)


def test_zero_delta_is_exact_token_for_token(pipe):
    sc = SamplingConfig(cfg_scale=2.0)
    exact = pipe.generate([0, 1, 2], DecodeConfig(sampling=sc, drafting="eagle1-25"), seed=3)
    for kw in (dict(acceptance="lantern", k=10, delta=0.0), dict(acceptance="lantern++", k=10, lam=1.0)):
        relaxed = pipe.generate([0, 1, 2], DecodeConfig(sampling=sc, drafting="eagle1-25", **kw), seed=3)
        assert torch.equal(exact.tokens, relaxed.tokens)
        assert relaxed.stats.moved_mass == [0.0] * len(relaxed.stats.moved_mass)


@pytest.mark.parametrize("kw", [dict(acceptance="lantern", k=20, delta=0.2), dict(acceptance="lantern++", k=20, lam=4.0)])
def test_relaxed_generation_moves_mass_within_bounds_and_accepts_more(pipe, kw):
    sc = SamplingConfig(cfg_scale=1.0)
    exact = pipe.generate(list(range(4)), DecodeConfig(sampling=sc, drafting="lantern++-57"), seed=1)
    relaxed = pipe.generate(list(range(4)), DecodeConfig(sampling=sc, drafting="lantern++-57", **kw), seed=1)
    moved = relaxed.stats.moved_mass
    assert moved and max(moved) > 0
    if kw["acceptance"] == "lantern":
        assert max(moved) <= kw["delta"] + 1e-9
    assert relaxed.stats.mean_accepted_length >= exact.stats.mean_accepted_length


def exact_ar_distribution(target, cls: int, n: int, cfg_scale: float) -> torch.Tensor:
    """P(first n tokens) of AR sampling, by enumeration: (V,)*n probabilities."""
    v = target.config.vocab_size
    seqs = torch.tensor(list(itertools.product(range(v), repeat=n)))
    with torch.no_grad():
        lc, _ = target.forward_full(seqs[:, :-1], torch.full((len(seqs),), cls))
        lu, _ = target.forward_full(seqs[:, :-1], torch.full((len(seqs),), target.config.num_classes))
    logp = torch.log_softmax(lu + cfg_scale * (lc - lu), -1)  # (S, n, V): position t predicts token t
    return logp.gather(-1, seqs[:, :, None])[..., 0].sum(1).exp()


@pytest.mark.parametrize("rule", ["exact", "broken"])
def test_exact_speculative_sampling_matches_ar_distribution(micro, tmp_path, monkeypatch, rule):
    """The first 2 tokens of 2x2 images (36 outcomes) over many seeds: chi-square against the exact AR
    distribution. A deliberately broken acceptance rule (accept with the drafter's raw q, never q_i, and
    subtract the wrong residual) must fail the same test."""
    target, drafter, proximity = micro
    if rule == "broken":
        import lantern.decoding.acceptance as acc

        def broken(p, kids, tok, q, rule_, generator):
            for c in kids:
                if float(torch.rand((), generator=generator)) < float(p[tok[c]]) * 1.5:  # over-accepts drafts
                    return c, p, 0.0
            return None, p, 0.0
        monkeypatch.setattr(acc, "_choose_sampling", broken)
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps([[0], [1], [2], [0, 0], [0, 1], [1, 0]]))
    pipe = Pipeline(target, drafter, proximity, backend="cpu")
    dcfg = DecodeConfig(sampling=SamplingConfig(cfg_scale=1.5), drafting=str(tree))
    counts = torch.zeros(36)
    trials = 1500
    for seed in range(trials):
        toks = pipe.generate([1], dcfg, seed=seed).tokens[0]
        counts[int(toks[0]) * 6 + int(toks[1])] += 1
    expected = exact_ar_distribution(target, 1, 2, 1.5) * trials
    keep = expected >= 5  # chi-square needs expected counts >= 5: pool the rare outcomes
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    pvalue = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    if rule == "exact":
        assert pvalue > SIGNIFICANCE
    else:
        assert pvalue < SIGNIFICANCE


def test_bad_inputs_name_the_value(pipe):
    dcfg = DecodeConfig(sampling=SamplingConfig(greedy=True))
    with pytest.raises(ValueError, match=r"class id 4 is out of range; allowed: integers 0..3"):
        pipe.generate([4], dcfg)
    with pytest.raises(ValueError, match=r"lambda 0.9 must be >= 1"):
        DecodeConfig(acceptance="lantern++", lam=0.9)
    with pytest.raises(ValueError, match=r"delta 2.0 is outside \[0, 1\]"):
        DecodeConfig(acceptance="lantern", delta=2.0)
    with pytest.raises(ValueError, match="neither a preset"):
        DecodeConfig(drafting="bushy-99")
    no_drafter = Pipeline(pipe.target, None, None, backend="cpu")
    with pytest.raises(ValueError, match="needs a drafter"):
        no_drafter.generate([0], DecodeConfig(drafting="chain-5"))
