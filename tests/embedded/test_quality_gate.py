"""The quality gate can fail (lantern.embedded.quality_gate): at LANTERN's class-to-image setting (the whole vocabulary,
CFG 4.0) on the embedded model, it rejects a sampler that draws tokens uniformly, the relaxation the bundle used to
ship for mc-sjd-relaxed (LANTERN form, k = 1000, delta = 1.0), and a sampler whose images keep their class but lose
their variety (greedy decoding: caught by the Frechet distance alone), and accepts AR at another seed. Its Frechet
limit comes from AR's seed-to-seed spread, which the random splits of AR's images estimate. Runs of 100 images are
gated against the reference the whole-vocabulary frontier ships (results/frontier-topkall-cfg4.json: AR over 6
seeds), runs of 16 against one built here over 3 seeds."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lantern.api import Pipeline
from lantern.bundle import load_bundle, weights_hash
from lantern.decoding import SamplingConfig, method_preset
from lantern.embedded.quality_gate import (MAX_TOKEN_TV, Reference, Scored, failed_checks, gate, heldout_features,
                                           measure, random_runs, sample, score, token_tv_bound)
from lantern.plan.validated import same_sampling

WHOLE = SamplingConfig(top_k=0, cfg_scale=4.0)
CLASSES, PER_CLASS = range(8), 2  # 16 images per run, decoded together
IMAGES = len(CLASSES) * PER_CLASS
SHIPPED = Path(__file__).resolve().parents[2] / "results" / "frontier-topkall-cfg4.json"


@pytest.fixture(scope="module")
def embedded():
    bundle = load_bundle()
    return bundle, Pipeline.from_bundle(bundle, backend="cpu"), heldout_features(bundle)


def run(embedded, dcfg, seed: int) -> tuple[Scored, float | None]:
    """One run of IMAGES images: its images scored and its mean recorded token TV (None if it records none)."""
    bundle, pipe, _ = embedded
    tv = []

    def generate(ids, s):
        # the config as given: the gate judges it (the library's policy would run an unvalidated one lossless)
        result = pipe.generate(ids.tolist(), dcfg, seed=s, batch=IMAGES, allow_relaxed=True)
        tv.extend(result.stats.token_tv)
        return result.tokens

    codes, labels = sample(generate, CLASSES, PER_CLASS, seed)
    return score(bundle, codes, labels), (sum(tv) / len(tv) if tv else None)


@pytest.fixture(scope="module")
def ar_reference(embedded):
    return Reference.of([run(embedded, method_preset("ar", WHOLE), seed)[0] for seed in (0, 1, 2)], embedded[2])


@pytest.fixture(scope="module")
def shipped_reference(embedded):
    """AR's reference at the whole vocabulary as the frontier shipped it, and its image count per class; only for
    the embedded target it was measured on."""
    rec = json.loads(SHIPPED.read_text())
    assert rec["target_hash"] == weights_hash(embedded[0].target.state_dict()), "rerun tools/quality_frontier.py"
    assert same_sampling(rec["sampling"], WHOLE, embedded[0].target.config.vocab_size)
    return Reference(rec["ar_spread"]), rec["per_class"]


def all_classes(bundle, per_class: int) -> torch.Tensor:
    return torch.arange(bundle.target.config.num_classes).repeat_interleave(per_class)


def gaussian_runs(rng, runs: int, n: int, shift: float = 0.0) -> list[Scored]:
    """Runs of n images of 4 classes whose features are standard normal in 8 dimensions (moved by `shift`)."""
    labels = np.repeat(np.arange(4), n // 4)
    return [Scored(rng.normal(shift, 1.0, (n, 8)), labels.copy(), labels) for _ in range(runs)]


def test_reference_needs_seeds_and_one_image_count():
    rng = np.random.default_rng(0)
    heldout = rng.normal(size=(200, 8))
    with pytest.raises(ValueError, match="at least 3"):
        Reference.of(gaussian_runs(rng, 2, 20), heldout)
    with pytest.raises(ValueError, match="same classes"):
        Reference.of(gaussian_runs(rng, 2, 20) + gaussian_runs(rng, 1, 24), heldout)
    with pytest.raises(ValueError, match="image count"):
        gate(Reference.of(gaussian_runs(rng, 3, 20), heldout), measure(gaussian_runs(rng, 1, 24)[0], heldout))


def test_random_runs_are_disjoint_and_keep_each_class_count():
    labels = np.repeat(np.arange(5), 12)
    runs = random_runs(labels, 4, np.random.default_rng(0))
    assert sorted(np.concatenate(runs).tolist()) == list(range(60))
    assert all(np.bincount(labels[r], minlength=5).tolist() == [3] * 5 for r in runs)
    with pytest.raises(ValueError, match="equal runs"):
        random_runs(labels, 5, np.random.default_rng(0))


def test_frechet_sd_from_splits_matches_the_spread_over_independent_runs():
    """The limit's sd, from 4 runs' pooled images, is the sd of a run's Frechet distance over independent runs (here
    of 40 standard-normal features, 300 of them) to within 25%: a bootstrap (resampling with repeats) or splits into
    runs of another size miss it."""
    rng = np.random.default_rng(1)
    heldout = rng.normal(size=(500, 8))
    truth = np.std([measure(r, heldout).frechet_distance for r in gaussian_runs(rng, 300, 40)], ddof=1)
    estimates = [Reference.of(gaussian_runs(rng, 4, 40), heldout, seed=i).spread["frechet_sd"] for i in range(8)]
    assert 0.75 < np.mean(estimates) / truth < 1.25, (np.mean(estimates), truth)


def test_limits_follow_ars_spread_not_one_runs_resampling():
    """With AR's images pooled, the Frechet limit sits Z * sqrt(1 + 1/S) sds above the mean, and a shift of the
    features that moves the Frechet distance by a few sds fails that check alone."""
    rng = np.random.default_rng(2)
    heldout = rng.normal(size=(500, 8))
    ref = Reference.of(gaussian_runs(rng, 5, 80), heldout)
    s = ref.spread
    assert s["frechet_limit"] == pytest.approx(s["frechet_mean"] + 3 * np.sqrt(1 + 1 / 5) * s["frechet_sd"])
    shifted = measure(gaussian_runs(rng, 1, 80, shift=0.35)[0], heldout)
    verdict = gate(ref, shifted)
    assert verdict["checks"]["class_accuracy"]["passed"] and not verdict["checks"]["frechet_distance"]["passed"]
    assert gate(ref, measure(gaussian_runs(rng, 1, 80)[0], heldout))["passed"]


@pytest.mark.slow
def test_gate_accepts_ar_at_another_seed(embedded, ar_reference):
    candidate, tv = run(embedded, method_preset("ar", WHOLE), seed=7)
    verdict = gate(ar_reference, measure(candidate, embedded[2]), tv)
    assert verdict["passed"], failed_checks(verdict)
    s = verdict["ar_spread"]  # the spread is reported, limits derived from it
    assert s["seeds"] == 3 and s["images_per_run"] == IMAGES and s["accuracy_limit"] < s["accuracy_mean"]
    assert s["frechet_limit"] > s["frechet_mean"] and s["frechet_sd"] > 0 and len(s["frechet_per_seed"]) == 3


def test_gate_rejects_uniform_tokens(embedded, shipped_reference):
    bundle, _, heldout = embedded
    ref, per_class = shipped_reference
    labels = all_classes(bundle, per_class)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, bundle.target.config.vocab_size, (len(labels), bundle.target.config.block_size),
                          generator=g)
    verdict = gate(ref, measure(score(bundle, codes, labels), heldout))
    assert not verdict["passed"]
    assert not verdict["checks"]["class_accuracy"]["passed"] and not verdict["checks"]["frechet_distance"]["passed"]


@pytest.mark.slow
def test_frechet_distance_alone_rejects_greedy_images(embedded, shipped_reference):
    """Top-k 1 draws each class's one most likely image every time: the images keep their class (accuracy passes)
    but not AR's variety, which only the Frechet distance sees. (Each class's image is decoded once and repeated:
    the images of a class are the same whatever the seed.)"""
    bundle, pipe, heldout = embedded
    ref, per_class = shipped_reference
    labels = all_classes(bundle, per_class)
    classes = all_classes(bundle, 1)
    once = pipe.generate(classes.tolist(), method_preset("ar", SamplingConfig(top_k=1, cfg_scale=4.0)), seed=0,
                         batch=len(classes)).tokens
    codes = once.repeat_interleave(per_class, 0)
    verdict = gate(ref, measure(score(bundle, codes, labels), heldout))
    assert verdict["checks"]["class_accuracy"]["passed"], failed_checks(verdict)
    assert not verdict["checks"]["frechet_distance"]["passed"]


@pytest.mark.slow
def test_gate_rejects_the_old_mc_sjd_relaxed_default_at_whole_vocabulary(embedded, ar_reference):
    """LANTERN form, k = 1000 of 1024 codes, delta = 1.0: at top-k 5 the support limited what could move; over
    the whole vocabulary each token's distribution moves almost entirely and the images are noise."""
    dcfg = method_preset("mc-sjd-relaxed", WHOLE, acceptance="lantern", k=1000, delta=1.0, form="bounded")
    candidate, tv = run(embedded, dcfg, seed=0)
    verdict = gate(ar_reference, measure(candidate, embedded[2]), tv,
                   token_tv_bound(dcfg.acceptance, dcfg.delta, dcfg.form))
    assert not verdict["passed"]
    assert tv > MAX_TOKEN_TV and not verdict["checks"]["token_tv_mean"]["passed"]
    # not only its recorded TV: the images themselves fail
    assert not (verdict["checks"]["class_accuracy"]["passed"] and verdict["checks"]["frechet_distance"]["passed"])
