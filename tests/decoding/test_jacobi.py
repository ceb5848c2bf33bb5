"""Speculative Jacobi decoding (SJD, MC-SJD, relaxed) end to end: lossless, greedy parity, relaxed target,
host transfers, bad input, a bundle without a drafter."""
import json
import shutil
from dataclasses import replace

import pytest
import torch

import lantern.decoding.jacobi as jacobi
import lantern.engine.proposers as proposers
from lantern.api import Pipeline
from lantern.bundle import DEFAULT_BUNDLE
from lantern.models.config import GPTConfig
from lantern.decoding import DecodeConfig, SamplingConfig, method_preset
from lantern.decoding.relaxation import NeighbourLinks, bounded_target
from lantern.decoding.sampling import Support, warp
from lantern.models.gpt import GPT
from lantern.models.proximity import build_proximity_table
from test_backend_onnx import needs_ort
from host_budget import check_host_budget
from test_speculative import LEVEL, SAMPLING, ar_distribution, flat_micro, pvalue, pvalues, sampled_counts

JACOBI = {"sjd": dict(drafting="jacobi", coupling="none"), "mc-sjd": dict(drafting="jacobi", coupling="gumbel"),
          "mc-sjd initial=last": dict(drafting="jacobi", coupling="gumbel", initial="last"),
          # branching windows: every depth branches (a full tree), or the first one with a stale tail after it
          "mc-sjd-pac full": dict(drafting="jacobi", coupling="gumbel", branching=3, branch_depth=3),
          "mc-sjd-pac tail": dict(drafting="jacobi", coupling="gumbel", branching=2, branch_depth=1, tail=2),
          "sjd-pac": dict(drafting="jacobi", coupling="none", branching=2, branch_depth=2, tail=1),
          # a fan: two more candidates for the first position, past top-k's support (drawn from the mixture)
          "mc-sjd-pac fan": dict(drafting="jacobi", coupling="gumbel", branching=2, branch_depth=1, fan=2)}


@pytest.fixture(scope="module")
def flat():
    target, _ = flat_micro()
    expected = {c: ar_distribution(target, c, SAMPLING) for c in range(3)}
    return Pipeline(target, None, None, backend="cpu"), expected


@pytest.fixture(scope="module")
def flat_near(flat):
    """The same target with a codebook's proximity lists: a branching window goes on from the candidate nearest
    the bonus."""
    pipe, expected = flat
    codebook = torch.randn(pipe.target.config.vocab_size, 4, generator=torch.Generator().manual_seed(5))
    return Pipeline(pipe.target, None, build_proximity_table(codebook, 5), backend="cpu"), expected


@pytest.fixture(scope="module")
def flat_top2(flat):
    """The same target cut to its top 2 tokens (of 6): a fan's candidates past them come from the uncut part of
    the mixture, and a fan tested against the wrong one of its two parts misses AR's law by much."""
    pipe, _ = flat
    return pipe, {c: ar_distribution(pipe.target, c, TOP2) for c in range(3)}


TOP2 = SamplingConfig(temperature=1.3, top_k=2, cfg_scale=1.5)


def run_lossless(flat, method, batch, window=2, sampling=SAMPLING):
    pipe, expected = flat
    dcfg = DecodeConfig(sampling=sampling, window=window, **JACOBI[method])
    if batch == 1:  # one image per static step: 600 runs
        counts = sampled_counts(pipe, dcfg, [1] * 600, calls=1, batch=1)
    else:  # three classes, 2000 images each, all in one batch
        counts = sampled_counts(pipe, dcfg, [0, 1, 2] * 2000, calls=1, batch=6000)
    return [p for c in counts for p in pvalues(counts[c], expected[c])]


@pytest.mark.parametrize("method, batch, window", [("sjd", 6000, 2), ("sjd", 6000, 3), ("mc-sjd", 1, 2),
                                                   ("mc-sjd", 6000, 2), ("mc-sjd", 6000, 3),
                                                   ("mc-sjd initial=last", 6000, 2), ("mc-sjd-pac full", 1, 2),
                                                   ("mc-sjd-pac full", 6000, 3), ("mc-sjd-pac tail", 6000, 3),
                                                   ("mc-sjd-pac tail", 6000, 2), ("sjd-pac", 6000, 3),
                                                   ("mc-sjd-pac fan", 1, 2), ("mc-sjd-pac fan", 6000, 3)])
def test_jacobi_sampling_reproduces_ar_for_every_image(flat, method, batch, window):
    """Every token of 2x2 images, CFG + temperature + top-k + top-p: each image's joint distribution of its 4
    tokens and every token's marginal equal AR's exact ones (chi-square), one image per step and batched.
    Window 2 slides new positions in (the token above where the 2x2 grid has one, else drawn from the last p);
    window 3 covers the image after the root. A branching window verifies more candidates of the first positions
    (draws without replacement from the window's q, on the coupled noise) and commits paths off its chain; a fan
    adds candidates for the first position, drawn past top-k's 5 tokens (from the cut q mixed with the uncut one).
    (B = 1 runs the coupled form only: its window state is the one with more to get wrong.)"""
    assert min(run_lossless(flat, method, batch, window)) > LEVEL


@pytest.mark.parametrize("method, batch, window", [("mc-sjd-pac full", 1, 2), ("mc-sjd-pac full", 6000, 3),
                                                   ("mc-sjd-pac tail", 6000, 2), ("mc-sjd-pac fan", 6000, 3)])
def test_a_branching_window_going_on_from_the_candidate_nearest_the_bonus_reproduces_ar(flat_near, method, batch,
                                                                                         window):
    """With a proximity table, after the candidates of a position are rejected, the window's next q comes from
    the candidate nearest the bonus (its subtree) instead of the chain's: still AR's distribution."""
    assert min(run_lossless(flat_near, method, batch, window)) > LEVEL


def test_drafts_not_drawn_from_the_stand_in_they_are_tested_against_fail_the_lossless_test(flat_near, monkeypatch):
    """A broken stand-in: the window's q comes from the candidate nearest the bonus, but its drafts are still
    the chain's (drawn from the chain's q). The test must notice."""
    real_advance = proposers.WindowProposal.advance

    def drafts_from_the_chain(self, slots, step):
        monkeypatch.setattr(self, "_stand_in", lambda step, last: last, raising=False)
        real_advance(self, slots, step)
        drafts, offered = self.drafts, self.offered
        monkeypatch.delattr(self, "_stand_in")
        real_advance(self, slots, step)
        self.drafts, self.offered = drafts, offered
    monkeypatch.setattr(proposers.WindowProposal, "advance", drafts_from_the_chain)
    assert min(run_lossless(flat_near, "mc-sjd-pac full", 6000, window=3)) < LEVEL


def test_testing_against_the_wrong_distribution_fails_the_lossless_test(flat, monkeypatch):
    """A broken coupling: drafts drawn from the previous step's q but tested against this step's p (what the
    draft would be if it were drawn now). Acceptance then always succeeds, and the test must notice."""
    real = proposers.accept

    def against_p(p_nodes, tree, *args):
        current = Support(p_nodes.probs[:, :-1], p_nodes.ids[:, :-1])
        return real(p_nodes, replace(tree, q=current), *args)
    monkeypatch.setattr(proposers, "accept", against_p)
    assert min(run_lossless(flat, "mc-sjd", 6000)) < LEVEL


def test_a_prior_tested_against_the_wrong_distribution_fails_the_lossless_test(flat, monkeypatch):
    """A broken spatial prior: drafts are the token above, but the test is told they came from the last p."""
    real_prior, real_redraw = proposers.spatial_prior, proposers.redraw
    drawn_from = {}

    def prior_kept_apart(q, *args):
        drawn_from["q"] = real_prior(q, *args)
        return q

    def redraw_from_prior(q, noise, greedy, generator, n=1):
        return real_redraw(drawn_from.pop("q", q), noise, greedy, generator, n)
    monkeypatch.setattr(proposers, "spatial_prior", prior_kept_apart)
    monkeypatch.setattr(proposers, "redraw", redraw_from_prior)
    assert min(run_lossless(flat, "mc-sjd", 6000)) < LEVEL


def test_a_branching_window_whose_candidates_repeat_fails_the_lossless_test(flat, monkeypatch):
    """A broken branching window: its candidates are independent draws from q (so one may repeat another) but
    are tested as draws without replacement. The test must notice."""
    real = proposers.redraw

    def with_replacement(q, noise, greedy, generator, n=1):
        drawn = [real(q, None, greedy, generator) for _ in range(n)]
        return torch.cat([t for t, _ in drawn], -1), torch.cat([v for _, v in drawn], -1)
    monkeypatch.setattr(proposers, "redraw", with_replacement)
    assert min(run_lossless(flat, "mc-sjd-pac full", 6000, window=3)) < LEVEL


@pytest.mark.parametrize("batch, window", [(1, 2), (6000, 3)])
def test_a_fan_past_a_narrow_top_k_reproduces_ar(flat_top2, batch, window):
    """Top-k 2 of 6 tokens: the branching takes both of the cut distribution's tokens, and the fan's two more
    are drawn from the mixture's uncut part, exactly (the joint and marginals equal AR's at top-k 2)."""
    assert min(run_lossless(flat_top2, "mc-sjd-pac fan", batch, window, TOP2)) > LEVEL


def test_a_fan_tested_against_the_uncut_distribution_fails_the_lossless_test(flat_top2, monkeypatch):
    """A broken fan: the window's candidates are drawn from the mixture but tested as if drawn from the uncut
    distribution mixed into it. The test must notice."""
    real_fan, real_redraw = proposers.fan_drafts, proposers.redraw
    drawn_from = {}

    def told_the_uncut_one(q, broad, vocab):
        drawn_from["q"] = real_fan(q, broad, vocab)
        return broad

    def redraw_from_the_mixture(q, noise, greedy, generator, n=1):
        return real_redraw(drawn_from.pop("q", q), noise, greedy, generator, n)
    monkeypatch.setattr(proposers, "fan_drafts", told_the_uncut_one)
    monkeypatch.setattr(proposers, "redraw", redraw_from_the_mixture)
    monkeypatch.setitem(JACOBI, "fan last", dict(JACOBI["mc-sjd-pac fan"], initial="last"))  # no prior to mix up
    assert min(run_lossless(flat_top2, "fan last", 6000, 3, TOP2)) < LEVEL


def test_a_fan_mixes_a_little_of_the_uncut_distribution_into_the_cut_one():
    """fan_drafts: on the uncut support, (1 - FAN_SHARE) of the cut q plus FAN_SHARE of the uncut one, so every
    token of the fan has some mass; widened: the same distribution on a wider static support, distinct ids."""
    logits = torch.randn(3, 2, 20, generator=torch.Generator().manual_seed(1))
    cut = warp(logits, SamplingConfig(top_k=4))
    vals, ids = torch.topk(logits, 9, dim=-1)
    mixed = jacobi.fan_drafts(cut, Support(torch.softmax(vals, -1), ids), 20)
    assert torch.equal(mixed.ids, ids) and torch.allclose(mixed.probs.sum(-1), torch.ones(3, 2))
    share = jacobi.FAN_SHARE
    assert torch.allclose(mixed.probs[..., :4], (1 - share) * cut.probs + share * torch.softmax(vals, -1)[..., :4])
    assert (mixed.probs[..., 4:] > 0).all()
    wide = jacobi.widened(cut, 9, 20)
    assert torch.equal(wide.ids[..., :4], cut.ids) and torch.equal(wide.probs[..., :4], cut.probs)
    assert (wide.probs[..., 4:] == 0).all() and all(len(set(r)) == 9 for r in wide.ids.flatten(0, 1).tolist())


def test_a_fan_adds_leaves_at_the_first_depth_after_the_branching_candidates():
    """WindowTree's fan: ranks K .. K + fan - 1 at depth 1, each a leaf, drawn from slot 0's ranked drafts."""
    plain, fanned = jacobi.WindowTree(4, 2, 2), jacobi.WindowTree(4, 2, 2, fan=3)
    assert fanned.size == plain.size + 3 and fanned.ranks == 5
    paths = fanned.compiled.paths
    assert {(2,), (3,), (4,)} <= set(paths) and not any(len(p) > 1 and p[0] >= 2 for p in paths)
    at = {p: i + 1 for i, p in enumerate(paths)}
    assert [int(fanned.draft[at[(r,)]]) for r in range(5)] == [0, 1, 2, 3, 4]  # slot 0's ranks
    assert int(fanned.draft[at[(1, 1)]]) == 5 + 1 and int(fanned.draft[at[(0, 0, 0)]]) == 2 * 5  # slot 1, slot 2


def test_coupled_noise_is_fixed_per_image_position_and_token_and_fresh_elsewhere():
    """A (position, token) reads the same Gumbel at every step and in any order; another position, another token
    or another seed reads a fresh one; the values are Gumbel distributed (Kolmogorov-Smirnov) and independent
    across tokens and of the stream's own draws."""
    from scipy.stats import kstest
    from lantern.engine.draws import SlotDraws
    g = torch.Generator().manual_seed(0)
    b, window, vocab, k = 2000, 3, 50, 4
    draws = SlotDraws(b, "cpu")
    draws.admit(torch.arange(b), torch.arange(b) * 7919 + 1)
    draws.begin()
    noise = jacobi.CoupledNoise()
    positions = torch.arange(1, window + 1).expand(b, -1)  # (B, L)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(b * window)]).view(b, window, k)
    first = noise.at(positions, ids, draws)
    draws.begin(torch.ones(b, dtype=torch.bool))  # a later step
    stream = draws.uniform((b, window * k)).view(b, window, k)
    again = noise.at(positions, ids.flip(-1), draws).flip(-1)  # same tokens, another order: same values
    assert torch.equal(first, again)
    later = noise.at(positions + window, ids, draws)  # the next positions
    assert (later == first).float().mean() < 1e-3  # 23-bit uniforms: a few equal by chance
    draws.admit(torch.arange(b), torch.arange(b) * 7919 + 2)  # other seeds
    assert (noise.at(positions, ids, draws) == first).float().mean() < 1e-3
    values = torch.cat([first.flatten(), later.flatten()]).double()
    assert kstest(values.numpy(), "gumbel_r").pvalue > 1e-3
    assert abs(torch.corrcoef(first[..., :2].reshape(-1, 2).T)[0, 1]) < 0.03
    assert abs(torch.corrcoef(torch.stack([first.flatten(), stream.flatten()]))[0, 1]) < 0.03


def test_sticky_drafts_fail_the_lossless_test(flat, monkeypatch):
    """A broken coupling: the draft keeps last step's token whenever it is still possible under the new q
    (a "sticky" draft), so it is not distributed as q. The test must notice."""
    real = proposers.redraw
    previous = {}

    def sticky(q, noise, greedy, generator, n=1):
        fresh, offered = real(q, noise, greedy, generator, n)
        old = previous.get("drafts")
        if old is not None and old.shape == fresh.shape:
            fresh = torch.where(q.prob_of(old) > 0, old, fresh)
        previous["drafts"] = fresh
        return fresh, offered
    monkeypatch.setattr(proposers, "redraw", sticky)
    assert min(run_lossless(flat, "sjd", 6000)) < LEVEL


# --- greedy: token for token AR --------------------------------------------------------------------------

def sharp_target():
    cfg = GPTConfig(dim=64, n_layer=1, n_head=4, vocab_size=64, num_classes=4, block_size=16, multiple_of=32)
    torch.manual_seed(0)
    target = GPT(cfg).eval()
    with torch.no_grad():
        target.output.weight.mul_(8.0)
    return target


@pytest.fixture(scope="module")
def sharp():
    return sharp_target()


def greedy_parity(pipe, cfg_scale: float) -> int:
    """Greedy Jacobi (both couplings, windows 3 and 15, a branching window) equals greedy AR for B = 1 and B = 3;
    returns the longest accepted run."""
    sc = SamplingConfig(greedy=True, cfg_scale=cfg_scale)
    longest = 0
    for classes in ([1], [1, 3, 0]):
        ar = pipe.generate(classes, DecodeConfig(sampling=sc), seed=0)
        for window, coupling, branches in ((3, "gumbel", {}), (15, "none", {}),
                                           (6, "gumbel", dict(branching=3, branch_depth=2, tail=2))):
            jac = pipe.generate(classes, DecodeConfig(sampling=sc, drafting="jacobi", window=window,
                                                      coupling=coupling, **branches), seed=0)
            assert torch.equal(ar.tokens, jac.tokens), (classes, window)
            for image in jac.stats.images:
                assert sum(image.accepted_lengths) + 1 == image.tokens
                assert image.target_forwards == 1 + len(image.accepted_lengths)
            longest = max(longest, *jac.stats.accepted_lengths)
    return longest


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_jacobi_equals_greedy_ar(sharp, cfg_scale):
    assert greedy_parity(Pipeline(sharp, None, None, backend="cpu"), cfg_scale) >= 3  # multi-token steps


@needs_ort
def test_greedy_jacobi_equals_greedy_ar_on_onnx(sharp, monkeypatch, tmp_path_factory):
    monkeypatch.setenv("LANTERN_ONNX_CACHE", str(tmp_path_factory.getbasetemp() / "jacobi-onnx-cache"))
    assert greedy_parity(Pipeline(sharp, None, None, backend="onnx"), 2.0) >= 3


# --- relaxed: the output is p_hat, within the recorded TV --------------------------------------------------

JACOBI_WINDOW = dict(drafting="jacobi", coupling="gumbel", window=2)
RELAXED_RULES = [dict(acceptance="lantern++", k=3, lam=4.0),  # a cap per receiver
                 dict(acceptance="lantern", k=3, delta=1.0)]  # no cap that binds, as the embedded bundle ships it


def first_pair_targets(target, proximity, cls: int, sc: SamplingConfig, rule: dict):
    """The first two tokens: AR's P(x0, x1) and the relaxed P(x0) p_hat(x1 | x0), where the first step tests
    token 1 against q = p(x0) (the prefill's distribution: position 1 was never predicted). (6, 6) each,
    and TV(p_hat, p) per x0 (6,)."""
    v = target.config.vocab_size
    x0 = torch.arange(v)[:, None]
    with torch.no_grad():
        lc, _ = target.forward_full(x0, torch.full((v,), cls))
        lu, _ = target.forward_full(x0, torch.full((v,), target.config.num_classes))
    dist = warp(lu + sc.cfg_scale * (lc - lu), sc)  # (6, 2, K): token 0, token 1 given x0
    p0, p1 = dist.dense(v)[0, 0], Support(dist.probs[:, 1:], dist.ids[:, 1:])  # (V,), (6, 1, K)
    p_hat, moved = bounded_target(p1, p0[p1.ids], NeighbourLinks(proximity[:, :rule["k"]]), v, rule.get("delta"),
                                  rule.get("lam"))
    relaxed = Support(p_hat, p1.ids).dense(v)[:, 0]  # (6, V)
    return p0[:, None] * p1.dense(v)[:, 0], p0[:, None] * relaxed, moved[:, 0]


@pytest.mark.parametrize("rule", RELAXED_RULES)
def test_relaxed_jacobi_outputs_p_hat_within_the_recorded_tv(rule):
    target, _ = flat_micro()
    torch.manual_seed(5)
    proximity = build_proximity_table(torch.nn.functional.normalize(torch.randn(6, 4), dim=1), 5)
    pipe = Pipeline(target, None, proximity, backend="cpu")
    ar, relaxed, moved = first_pair_targets(target, proximity, 1, SAMPLING, rule)
    assert 0.5 * (relaxed - ar).abs().sum() > 0.05  # p_hat really differs from p
    result = pipe.generate([1] * 6000, DecodeConfig(sampling=SAMPLING, **JACOBI_WINDOW, **rule), seed=0, batch=6000)
    pairs = result.tokens[:, 0] * 6 + result.tokens[:, 1]
    counts = torch.bincount(pairs, minlength=36).float()
    assert pvalue(counts, relaxed.flatten()) > LEVEL
    assert pvalue(counts, ar.flatten()) < LEVEL
    recorded = torch.tensor([image.token_tv[0] for image in result.stats.images])  # token 1's TV(p_hat, p)
    assert torch.allclose(recorded, moved[result.tokens[:, 0]], atol=1e-5)
    p1 = ar / ar.sum(1, keepdim=True).clamp_min(1e-30)
    tv = 0.5 * (relaxed / relaxed.sum(1, keepdim=True).clamp_min(1e-30) - p1).abs().sum(1)
    assert torch.allclose(tv[result.tokens[:, 0]], recorded, atol=1e-5)


# --- structure and input --------------------------------------------------------------------------------

def test_each_jacobi_step_moves_only_a_flag_to_the_host(sharp, monkeypatch):
    """Between two acceptance phases (one whole step): at most 2 host syncs; O(B * L) elements plus each
    finishing image's tokens and records once. The decode core is what is counted: the eager runner's
    attention trim (a CPU-only host read of each mask) is off."""
    pipe = Pipeline(sharp, None, None, backend="cpu")
    dcfg = DecodeConfig(sampling=SamplingConfig(cfg_scale=2.0, top_k=20), drafting="jacobi", window=4)
    check_host_budget(pipe, dcfg, "accept", monkeypatch)


def test_same_seed_same_tokens(flat):
    pipe, _ = flat
    dcfg = DecodeConfig(sampling=SAMPLING, drafting="jacobi", window=2)
    a, b = (pipe.generate([0, 1, 2] * 20, dcfg, seed=3).tokens for _ in range(2))
    assert torch.equal(a, b)


def test_bad_inputs_name_the_value(flat):
    pipe, _ = flat
    with pytest.raises(ValueError, match=r"window 0 must be an integer >= 1"):
        DecodeConfig(drafting="jacobi", window=0)
    with pytest.raises(ValueError, match=r"unknown coupling 'maximal'; allowed: none, gumbel"):
        DecodeConfig(drafting="jacobi", coupling="maximal")
    with pytest.raises(ValueError, match=r"window 4 must be below the image's 4 tokens"):
        pipe.generate([0], DecodeConfig(drafting="jacobi", window=4))
    with pytest.raises(ValueError, match="needs a proximity table"):
        pipe.generate([0], method_preset("mc-sjd-relaxed", SamplingConfig(), window=2))
    with pytest.raises(ValueError, match=r"branching 0 must be an integer >= 1"):
        DecodeConfig(drafting="jacobi", branching=0)
    with pytest.raises(ValueError, match=r"tail -1 must be an integer >= 0"):
        DecodeConfig(drafting="jacobi", branching=2, tail=-1)


def test_a_bundle_without_a_drafter_runs_jacobi_from_the_cli(tmp_path, capsys):
    """`lantern info` lists what the bundle supports; mc-sjd runs, a drafting method is refused (exit 2)."""
    from lantern.cli import main
    bundle = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE, bundle)
    (bundle / "drafter.safetensors").unlink()
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["files"]["drafter.safetensors"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert main(["info", "--model", str(bundle), "--json"]) == 0
    methods = json.loads(capsys.readouterr().out)["methods"]
    assert methods == ["ar", "sjd", "mc-sjd", "mc-sjd-pac", "mc-sjd-relaxed"]
    common = ["generate", "--model", str(bundle), "--classes", "2", "--greedy", "--no-images", "--json"]
    assert main(common + ["--method", "mc-sjd", "--window", "8"]) == 0
    jac = json.loads(capsys.readouterr().out)
    assert len(jac["tokens"][0]) == 256 and jac["target_forwards"] < 256 and jac["decode"]["window"] == 8
    pac = ["--method", "mc-sjd-pac", "--window", "8", "--branching", "2", "--branch-depth", "2", "--tail", "1"]
    assert main(common + pac) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["tokens"] == jac["tokens"] and tree["decode"]["branching"] == 2  # greedy: AR's tokens, both
    assert main(common + ["--branching", "2"]) == 2  # auto chooses the window's shape itself
    assert "--branching" in capsys.readouterr().err
    assert main(common + ["--method", "lantern++"]) == 2
    assert "needs a drafter" in json.loads(capsys.readouterr().out)["error"]


@needs_ort
def test_export_onnx_of_a_jacobi_method_has_the_window_verify_and_no_drafter(tmp_path, capsys):
    from lantern.cli import main
    argv = ["export-onnx", "--preset", "GPT-test", "--method", "mc-sjd", "--window", "4", "--cfg-scale", "1",
            "--batch", "1", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    assert sorted(json.loads(capsys.readouterr().out)["graphs"]) == ["commit", "prefill", "verify[5]"]
