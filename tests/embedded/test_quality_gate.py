"""The quality gate can fail (lantern.embedded.quality_gate): at LANTERN's class-to-image setting (the whole vocabulary,
CFG 4.0) on the embedded model, it rejects a sampler that draws tokens uniformly and the relaxation the bundle
used to ship for mc-sjd-relaxed (LANTERN form, k = 1000, delta = 1.0), and accepts AR at another seed."""
import pytest
import torch

from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding import SamplingConfig, method_preset
from lantern.embedded.quality_gate import (MAX_TOKEN_TV, Measure, Reference, failed_checks, gate, heldout_features, measure,
                                  sample, token_tv_bound)

WHOLE = SamplingConfig(top_k=0, cfg_scale=4.0)
CLASSES, PER_CLASS = range(8), 2  # 16 images per run, decoded together
IMAGES = len(CLASSES) * PER_CLASS


@pytest.fixture(scope="module")
def embedded():
    bundle = load_bundle()
    return bundle, Pipeline.from_bundle(bundle, backend="cpu"), heldout_features(bundle)


def run(embedded, dcfg, seed: int) -> tuple[Measure, float | None]:
    """One run of IMAGES images: its measure and its mean recorded token TV (None if it records none)."""
    bundle, pipe, reference = embedded
    tv = []

    def generate(ids, s):
        result = pipe.generate(ids.tolist(), dcfg, seed=s, batch=IMAGES)
        tv.extend(result.stats.token_tv)
        return result.tokens

    codes, labels = sample(generate, CLASSES, PER_CLASS, seed, chunk=IMAGES)
    return measure(bundle, codes, labels, reference, seed=seed), (sum(tv) / len(tv) if tv else None)


@pytest.fixture(scope="module")
def ar_reference(embedded):
    return Reference(tuple(run(embedded, method_preset("ar", WHOLE), seed)[0] for seed in (0, 1, 2)))


def test_reference_needs_seeds_and_one_image_count():
    m = Measure(0.9, 10.0, 16, 1.0)
    with pytest.raises(ValueError, match="at least 3"):
        Reference((m, m))
    with pytest.raises(ValueError, match="same number"):
        Reference((m, m, Measure(0.9, 10.0, 20, 1.0)))
    with pytest.raises(ValueError, match="image count"):
        gate(Reference((m, m, m)), Measure(0.9, 10.0, 20, 1.0))


@pytest.mark.slow
def test_gate_accepts_ar_at_another_seed(embedded, ar_reference):
    candidate, tv = run(embedded, method_preset("ar", WHOLE), seed=7)
    verdict = gate(ar_reference, candidate, tv)
    assert verdict["passed"], failed_checks(verdict)
    s = verdict["ar_spread"]  # the spread is reported, limits derived from it
    assert s["seeds"] == 3 and s["images_per_run"] == IMAGES and s["accuracy_limit"] < s["accuracy_mean"]
    assert s["frechet_limit"] > s["frechet_mean"] and s["frechet_bootstrap_sd"] > 0


def test_gate_rejects_uniform_tokens(embedded, ar_reference):
    bundle, _, reference = embedded
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, bundle.target.config.vocab_size, (IMAGES, bundle.target.config.block_size), generator=g)
    labels = torch.tensor(list(CLASSES)).repeat_interleave(PER_CLASS)
    verdict = gate(ar_reference, measure(bundle, codes, labels, reference))
    assert not verdict["passed"]
    assert not verdict["checks"]["class_accuracy"]["passed"] and not verdict["checks"]["frechet_distance"]["passed"]


@pytest.mark.slow
def test_gate_rejects_the_old_mc_sjd_relaxed_default_at_whole_vocabulary(embedded, ar_reference):
    """LANTERN form, k = 1000 of 1024 codes, delta = 1.0: at top-k 5 the support limited what could move; over
    the whole vocabulary each token's distribution moves almost entirely and the images are noise."""
    dcfg = method_preset("mc-sjd-relaxed", WHOLE, acceptance="lantern", k=1000, delta=1.0, form="bounded")
    candidate, tv = run(embedded, dcfg, seed=0)
    verdict = gate(ar_reference, candidate, tv, token_tv_bound(dcfg.acceptance, dcfg.delta, dcfg.form))
    assert not verdict["passed"]
    assert tv > MAX_TOKEN_TV and not verdict["checks"]["token_tv_mean"]["passed"]
    # not only its recorded TV: the images themselves fail
    assert not (verdict["checks"]["class_accuracy"]["passed"] and verdict["checks"]["frechet_distance"]["passed"])
