"""Batched speculative decoding end to end on the CPU backend, against AR decoding on the same model."""
import itertools
import json
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

import lantern.decoding.acceptance as acc
import lantern.engine.proposers as proposers
from lantern.api import Pipeline
from lantern.models.config import GPTConfig
from lantern.decoding import TREE_PRESETS, DecodeConfig, SamplingConfig, method_preset
from lantern.decoding.sampling import GuidedLogits, combine_cfg
from lantern.decoding.sampling import SamplingConfig as SC
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT
from host_budget import check_host_budget

SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def pipe(tiny):
    target, drafter, proximity = tiny
    return Pipeline(target, drafter, proximity, backend="cpu")


def derived_pair(cfg: GPTConfig, seed: int = 0, sharpen: float = 8.0):
    """A one-layer target and a drafter derived from it: the drafter's layer is the target's, fed the token
    embedding alone, so it predicts nearly what the target will (deep paths really get accepted)."""
    torch.manual_seed(seed)
    target = GPT(cfg).eval()
    with torch.no_grad():
        target.output.weight.mul_(sharpen)
        drafter = Drafter(cfg).eval()
        drafter.layer.load_state_dict(target.layers[0].state_dict())
        drafter.fc.weight.zero_()
        drafter.fc.bias.zero_()
        drafter.fc.weight[:, : cfg.dim] = torch.eye(cfg.dim)
    return target, drafter


@pytest.fixture(scope="module")
def derived():
    cfg = GPTConfig(dim=64, n_layer=1, n_head=4, vocab_size=64, num_classes=4, block_size=16, multiple_of=32)
    target, drafter = derived_pair(cfg)
    return Pipeline(target, drafter, None, backend="cpu")


@pytest.mark.parametrize("drafting", list(TREE_PRESETS) + ["dynamic"])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_speculative_equals_greedy_ar_with_deep_acceptance(derived, drafting, cfg_scale):
    sc = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    longest = 0
    for classes in ([1], [1, 3, 0]):  # B = 1 and B = 3
        ar = derived.generate(classes, DecodeConfig(sampling=sc), seed=0)
        spec = derived.generate(classes, DecodeConfig(sampling=sc, drafting=drafting, dynamic_top_k=2,
                                                      dynamic_total=12), seed=0)
        assert torch.equal(ar.tokens, spec.tokens)
        st = spec.stats
        longest = max(longest, *st.accepted_lengths)
        assert st.tokens == len(classes) * derived.config.block_size
        for image in st.images:  # per image: the prefill's token, then tau per step
            assert sum(image.accepted_lengths) + 1 == image.tokens
            assert image.target_forwards == 1 + len(image.accepted_lengths)
    assert longest >= 4  # paths of depth >= 3 accepted: multi-token commits happened


@pytest.mark.parametrize("drafting", ["lantern++-57", "dynamic"])
def test_images_decoded_together_equal_each_decoded_alone(derived, drafting):
    sc = SamplingConfig(greedy=True, cfg_scale=2.0)
    dcfg = DecodeConfig(sampling=sc, drafting=drafting, dynamic_total=12)
    together = derived.generate([0, 1, 2], dcfg, seed=0).tokens
    alone = torch.cat([derived.generate([c], dcfg, seed=0).tokens for c in (0, 1, 2)])
    assert torch.equal(together, alone)


def test_more_images_than_the_batch_run_in_chunks(derived):
    sc = SamplingConfig(greedy=True)
    dcfg = DecodeConfig(sampling=sc, drafting="chain-5")
    whole = derived.generate([0, 1, 2, 3, 0], dcfg, seed=0)
    chunked = derived.generate([0, 1, 2, 3, 0], dcfg, seed=0, batch=2)  # 2 + 2 + 1 (padded to 2)
    assert torch.equal(whole.tokens, chunked.tokens)
    assert whole.stats.batch == 5 and chunked.stats.batch == 2 and len(chunked.stats.images) == 5


def test_ar_counts_one_forward_per_token_per_image(pipe):
    st = pipe.generate([0, 1, 2], DecodeConfig(sampling=SamplingConfig(greedy=True)), seed=0).stats
    assert st.step_compression == 1.0 and st.target_forwards == 3 * pipe.config.block_size


def test_same_seed_same_tokens_and_different_seed_differs(pipe):
    dcfg = method_preset("lantern++", SamplingConfig(cfg_scale=2.0))
    a, b = (pipe.generate([0, 2], dcfg, seed=7) for _ in range(2))
    c = pipe.generate([0, 2], dcfg, seed=8)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)


@pytest.mark.parametrize("form", ["bounded", "paper"])
def test_zero_delta_is_exact_token_for_token(pipe, form):
    sc = SamplingConfig(cfg_scale=2.0)
    exact = pipe.generate([0, 1, 2], DecodeConfig(sampling=sc, drafting="eagle1-25"), seed=3)
    for kw in (dict(acceptance="lantern", k=10, delta=0.0), dict(acceptance="lantern++", k=10, lam=1.0)):
        relaxed = pipe.generate([0, 1, 2], DecodeConfig(sampling=sc, drafting="eagle1-25", form=form, **kw), seed=3)
        assert torch.equal(exact.tokens, relaxed.tokens)
        assert set(relaxed.stats.token_tv) == {0.0} and set(relaxed.stats.boost) <= {0.0}


@pytest.mark.parametrize("kw", [dict(acceptance="lantern", k=20, delta=0.2), dict(acceptance="lantern++", k=20, lam=4.0)])
def test_bounded_relaxation_records_true_tv_within_bounds_and_accepts_more(pipe, kw):
    sc = SamplingConfig(cfg_scale=1.0)
    exact = pipe.generate(list(range(4)), DecodeConfig(sampling=sc, drafting="lantern++-57"), seed=1)
    relaxed = pipe.generate(list(range(4)), DecodeConfig(sampling=sc, drafting="lantern++-57", **kw), seed=1)
    tv = relaxed.stats.token_tv
    assert tv and max(tv) > 0
    if kw["acceptance"] == "lantern":
        assert max(tv) <= kw["delta"] + 1e-6
    assert relaxed.stats.mean_accepted_length > exact.stats.mean_accepted_length


# --- lossless, end to end -------------------------------------------------------------------------------

def flat_micro():
    """6 tokens, 2x2 images: a mildly sharpened random target (no outcome dominates) and a random drafter with
    peaked, different distributions (so rejections, residuals and later siblings really matter)."""
    cfg = GPTConfig(dim=16, n_layer=1, n_head=2, vocab_size=6, num_classes=3, block_size=4, multiple_of=16)
    torch.manual_seed(11)
    target, drafter = GPT(cfg).eval(), Drafter(cfg).eval()
    with torch.no_grad():
        target.output.weight.mul_(6.0)
        drafter.layer.feed_forward.w2.weight.mul_(10.0)
        drafter.layer.attention.wo.weight.mul_(10.0)
    return target, drafter


SAMPLING = SC(temperature=1.3, top_k=5, top_p=0.95, cfg_scale=1.5)
LEVEL = 1e-4  # per p-value; 15 per run (3 classes x (joint + 4 marginals)): a lossless run fails 1.5e-3 of the time
DRAFTINGS = {"static": dict(drafting="TREE"), "chain": dict(drafting="CHAIN"),
             "dynamic": dict(drafting="dynamic", dynamic_depth=3, dynamic_top_k=3, dynamic_total=8)}


def ar_distribution(target, cls: int, sc: SC) -> torch.Tensor:
    """Exact P(all 4 tokens) of AR sampling with CFG, temperature, top-k and top-p, by enumeration (6**4,)."""
    from lantern.decoding.sampling import warp
    v, n = target.config.vocab_size, target.config.block_size
    seqs = torch.tensor(list(itertools.product(range(v), repeat=n)))
    with torch.no_grad():
        lc, _ = target.forward_full(seqs[:, :-1], torch.full((len(seqs),), cls))
        lu, _ = target.forward_full(seqs[:, :-1], torch.full((len(seqs),), target.config.num_classes))
    probs = warp(lu + sc.cfg_scale * (lc - lu), sc).dense(v)  # (S, n, V)
    return probs.gather(-1, seqs[:, :, None])[..., 0].prod(1)


def sampled_counts(pipe, dcfg, classes, calls, batch):
    counts = {c: torch.zeros(6 ** 4) for c in set(classes)}
    weights = torch.tensor([6 ** 3, 6 ** 2, 6, 1])
    for seed in range(calls):
        toks = pipe.generate(classes, dcfg, seed=seed, batch=batch).tokens
        for c, row in zip(classes, toks):
            counts[c][int((row * weights).sum())] += 1
    return counts


def pvalue(counts, expected_probs):
    expected = expected_probs * counts.sum()
    if counts[expected == 0].sum() > 0:  # an outcome AR cannot emit
        return 0.0
    keep = expected >= 5  # chi-square needs expected counts >= 5: pool the rare outcomes
    obs, exp = counts[keep], expected[keep]
    if expected[~keep].sum() > 0:
        obs, exp = torch.cat([obs, counts[~keep].sum()[None]]), torch.cat([exp, expected[~keep].sum()[None]])
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def pvalues(counts, expected):
    """The joint of the 4 tokens, and each token's marginal."""
    joint_c, joint_e = counts.reshape(6, 6, 6, 6), expected.reshape(6, 6, 6, 6)
    out = [pvalue(counts, expected)]
    for i in range(4):
        other = tuple(d for d in range(4) if d != i)
        out.append(pvalue(joint_c.sum(other), joint_e.sum(other)))
    return out


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    trees = {"TREE": [[0], [1], [2], [3], [4], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "CHAIN": [[0], [0, 0], [0, 0, 0]]}
    files = {}
    for name, paths in trees.items():
        files[name] = tmp_path_factory.mktemp("tree") / f"{name.lower()}.json"
        files[name].write_text(json.dumps(paths))
    target, drafter = flat_micro()
    expected = {c: ar_distribution(target, c, SAMPLING) for c in range(3)}
    return Pipeline(target, drafter, None, backend="cpu"), {name: str(f) for name, f in files.items()}, expected


def run_lossless(flat, drafting, batch):
    pipe, tree_files, expected = flat
    kw = {k: tree_files.get(v, v) for k, v in DRAFTINGS[drafting].items()}
    dcfg = DecodeConfig(sampling=SAMPLING, **kw)
    if batch == 1:  # one image per static step: 600 runs
        counts = sampled_counts(pipe, dcfg, [1] * 600, calls=1, batch=1)
    else:  # three classes, 2000 images each, all in one batch
        counts = sampled_counts(pipe, dcfg, [0, 1, 2] * 2000, calls=1, batch=6000)
    return [p for c in counts for p in pvalues(counts[c], expected[c])]


@pytest.mark.parametrize("drafting, batch", [("static", 1), ("static", 6000), ("dynamic", 1), ("dynamic", 6000),
                                             ("chain", 6000)])
@pytest.mark.slow
def test_exact_speculative_sampling_reproduces_ar_for_every_image(flat, drafting, batch):
    """Every token of 2x2 images, CFG + temperature + top-k + top-p: each image's joint distribution of its 4
    tokens and every token's marginal equal AR's exact ones (chi-square), one image per step and batched
    (a chain: accepted without the tree walk)."""
    assert min(run_lossless(flat, drafting, batch)) > LEVEL


def test_broken_residual_fails_the_lossless_test(flat, monkeypatch):
    """Testing and subtracting q instead of q_i on each rejection: biased, and the end-to-end test sees it."""
    monkeypatch.setattr(acc, "earlier_mass", lambda q_x, valid: torch.zeros_like(q_x))
    assert min(run_lossless(flat, "static", 6000)) < LEVEL


def test_verify_guided_with_another_cfg_scale_fails_the_lossless_test(flat, monkeypatch):
    """Verify rows guided with a different CFG scale than AR's: the test must notice."""
    monkeypatch.setattr(proposers.Proposer, "distributions",
                        lambda self, logits: GuidedLogits(combine_cfg(logits, 3.0, True), self.sampling))
    assert min(run_lossless(flat, "static", 6000)) < LEVEL


@pytest.mark.parametrize("kw", [dict(), dict(acceptance="lantern++", k=10, lam=2.0)])
def test_a_chain_is_accepted_without_the_tree_walk_token_for_token(pipe, kw, monkeypatch):
    """chain-5 is drafted as a chain, whose accepted path skips the walk; the same generation through the tree
    walk gives the same tokens and stats."""
    from lantern.decoding import trees
    assert trees.compile_tree(TREE_PRESETS["chain-5"]).is_chain
    assert not trees.compile_tree(TREE_PRESETS["chain-5"], pad_to=8).is_chain
    assert not trees.compile_tree(TREE_PRESETS["eagle1-25"]).is_chain
    dcfg = DecodeConfig(sampling=SamplingConfig(cfg_scale=2.0, top_k=20), drafting="chain-5", **kw)
    chains = []
    real = proposers.accept
    monkeypatch.setattr(proposers, "accept", lambda p, tree, *a: chains.append(tree.chain) or real(p, tree, *a))
    fast = pipe.generate([0, 1, 2], dcfg, seed=5)
    assert chains and all(chains)
    monkeypatch.setattr(proposers, "accept", lambda p, tree, *a: real(p, replace(tree, chain=False), *a))
    walked = pipe.generate([0, 1, 2], dcfg, seed=5)
    assert torch.equal(fast.tokens, walked.tokens)
    assert fast.stats.token_tv == walked.stats.token_tv
    assert [i.accepted_lengths for i in fast.stats.images] == [i.accepted_lengths for i in walked.stats.images]


# --- what crosses to the host ---------------------------------------------------------------------------

@pytest.mark.parametrize("drafting", ["lantern++-57", "dynamic"])
def test_each_speculative_step_moves_only_a_flag_to_the_host(pipe, drafting, monkeypatch):
    """Structural, not a timing: between two acceptance phases (one whole step) at most 2 host syncs; the step's
    report and finished flags, O(B * depth) elements, plus each finishing image's tokens and records once;
    never logits or distributions. The decode core is what is counted: the eager runner's attention trim,
    which reads each mask on the host and runs on a CPU only, is off."""
    dcfg = method_preset("lantern++", SamplingConfig(cfg_scale=2.0, top_k=20), drafting=drafting)
    check_host_budget(pipe, dcfg, "accept", monkeypatch)


def test_bad_inputs_name_the_value(pipe):
    dcfg = DecodeConfig(sampling=SamplingConfig(greedy=True))
    with pytest.raises(ValueError, match=r"class id 4 is out of range; allowed: integers 0..3"):
        pipe.generate([4], dcfg)
    with pytest.raises(ValueError, match=r"lambda 0.9 must be a finite number >= 1"):
        DecodeConfig(acceptance="lantern++", lam=0.9)
    with pytest.raises(ValueError, match=r"delta 2.0 is outside \[0, 1\]"):
        DecodeConfig(acceptance="lantern", delta=2.0)
    with pytest.raises(ValueError, match="neither a preset"):
        DecodeConfig(drafting="bushy-99")
    with pytest.raises(ValueError, match=r"batch 0 must be an integer >= 1"):
        pipe.generate([0], dcfg, batch=0)
    with pytest.raises(ValueError, match=r"k 5000 exceeds the proximity table's 63 neighbours"):
        pipe.generate([0], method_preset("lantern++", SamplingConfig(), k=5000))
    with pytest.raises(ValueError, match=r"tree depth 16 must be below the image's 16 tokens"):
        pipe.generate([0], DecodeConfig(drafting="dynamic", dynamic_depth=16))
    no_drafter = Pipeline(pipe.target, None, None, backend="cpu")
    with pytest.raises(ValueError, match="needs a drafter"):
        no_drafter.generate([0], DecodeConfig(drafting="chain-5"))
