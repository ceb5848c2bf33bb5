"""Retrain a tiny version of the embedded bundle's pipeline and check that every stage learns."""
import json

import numpy as np
import pytest
import torch

from lantern.models.config import gpt_preset
from lantern.embedded.metrics import frechet_distance
from lantern.models.classifier import ClassifierConfig
from lantern.models.vq import VQConfig
from lantern.embedded.train.drafter import feature_bank, target_features, train_drafter
from lantern.embedded.train.evaluator import train_evaluator
from lantern.embedded.train.pipeline import load_target, load_vq
from lantern.embedded.train.quality import choose_sampling
from lantern.embedded.train.selfsample import ar_sampler, self_samples
from lantern.embedded.train.target import target_loss, train_target
from lantern.embedded.train.tokenizer import train_tokenizer
from lantern.embedded.train.tokens import token_dataset

TINY_VQ = VQConfig(ch=8, ch_mult=(1, 2), z_channels=8, norm_groups=4, codebook_size=64, image_size=16)
TINY_GPT = gpt_preset("GPT-test", vocab_size=64, num_classes=10, block_size=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("tiny")
    vq_report = train_tokenizer(str(work), TINY_VQ, steps=40, batch=16, lr=3e-3, restart_every=10, progress=False)
    data = token_dataset(load_vq(work), n_aug=1, seed=0, cache_dir=str(work))
    tokens, labels = data["train"]
    target_report = train_target(str(work), TINY_GPT, tokens, labels, data["heldout"], steps=40, batch=16,
                                 lr=3e-3, progress=False)
    target = load_target(work)
    # 30 steps of 8 draw at most 240 sequences: the drafter's feature bank (every sequence it is given, twice)
    # needs no more than 256 of them, and its agreement is measured on 128 held-out ones
    heldout = tuple(t[:128] for t in data["heldout"])
    drafter_report = train_drafter(str(work), target, tokens[:256], labels[:256], heldout, steps=30, batch=8,
                                   lr=3e-3, progress=False)
    return dict(work=work, vq=vq_report, target=target_report, drafter=drafter_report, data=data, target_model=target)


def test_tokenizer_beats_mean_image(tiny):
    r = tiny["vq"]
    assert r["recon_mse"] < 0.6 * r["mean_image_mse"], r


def test_target_learns(tiny):
    tokens, labels = tiny["data"]["heldout"]
    fresh = load_target(tiny["work"]).apply(tiny["target_model"]._init_weights)  # same config, untrained
    with torch.no_grad():
        untrained = float(target_loss(fresh, tokens[:32], labels[:32]))
    assert tiny["target"]["heldout_ce"] < untrained - 1.0, (tiny["target"], untrained)
    assert 0 < tiny["target"]["mean_top1_prob"] < 1


def test_drafter_agrees_with_target_beyond_chance(tiny):
    r = tiny["drafter"]
    # both rows the drafter serves with classifier-free guidance: the class's and the null class's
    assert r["top1_agreement_cond"] > 5 / TINY_GPT.vocab_size, r
    assert r["top1_agreement_uncond"] > 5 / TINY_GPT.vocab_size, r


def test_self_samples_are_pipeline_ar_batches_cached_per_chunk(tiny):
    target, sampling = tiny["target_model"], {"cfg_scale": 2.0, "temperature": 1.0, "top_k": 8}
    tokens, labels = self_samples(tiny["work"], target, sampling, per_class_per_chunk=1, chunks=2, seed=5,
                                  progress=False)
    assert tokens.shape == (20, TINY_GPT.block_size) and tokens.dtype == torch.int64
    assert 0 <= int(tokens.min()) and int(tokens.max()) < TINY_GPT.vocab_size
    assert torch.equal(labels, torch.arange(10).repeat(2))  # every class in every chunk
    assert torch.equal(tokens[10:], ar_sampler(target, sampling)(torch.arange(10), 6))  # chunk 1 = seed 5 + 1
    chunk = tiny["work"] / "self_samples" / "chunk_001.safetensors"
    chunk.write_bytes(chunk.read_bytes())  # cached: read back, not resampled
    mtime = chunk.stat().st_mtime_ns
    again, _ = self_samples(tiny["work"], target, sampling, 1, 2, 5, progress=False)
    assert torch.equal(again, tokens) and chunk.stat().st_mtime_ns == mtime
    other, _ = self_samples(tiny["work"], target, {**sampling, "top_k": 1}, 1, 2, 5, progress=False)
    assert chunk.stat().st_mtime_ns != mtime and not torch.equal(other, tokens)  # another setting resamples


def test_token_cache_and_checkpoints_hold_no_pickled_code(tiny):
    assert (tiny["work"] / "tokens.safetensors").exists() and not list(tiny["work"].glob("*.pt"))
    state = torch.load(tiny["work"] / "target.ckpt", weights_only=True)  # plain tensors and data only
    assert state["step"] == 40


def test_sampling_rule_prefers_frechet_among_the_most_accurate():
    def report(acc, fd, k):
        return {"generated": {"class_accuracy": acc, "frechet_distance": fd}, "sampling": {"top_k": k}}
    reports = [report(0.90, 5.0, 1), report(0.97, 9.0, 2), report(0.96, 7.0, 3), report(0.94, 6.0, 4)]
    assert choose_sampling(reports) == {"top_k": 3}


def test_rerun_resumes_from_the_finished_checkpoint(tiny):
    tokens, labels = tiny["data"]["train"]
    before = load_target(tiny["work"]).state_dict()
    train_target(str(tiny["work"]), TINY_GPT, tokens, labels, tiny["data"]["heldout"], steps=40, batch=16,
                 lr=3e-3, progress=False)
    after = load_target(tiny["work"]).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_checkpoint_of_another_run_is_refused(tiny):
    tokens, labels = tiny["data"]["train"]
    with pytest.raises(ValueError, match="was made with config"):
        train_target(str(tiny["work"]), TINY_GPT, tokens, labels, tiny["data"]["heldout"], steps=41, batch=16,
                     lr=3e-3, progress=False)


def test_classifier_beats_chance(tmp_path):
    torch.set_num_threads(1)
    r = train_evaluator(str(tmp_path), ClassifierConfig(image_size=16, width=8, feature_dim=16), steps=60,
                        batch=32, lr=5e-3, progress=False)
    assert r["heldout_accuracy"] > 0.6, r


def test_frechet_distance_basics():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(500, 4))
    assert frechet_distance(a, a) == pytest.approx(0, abs=1e-6)
    # two unit Gaussians a mean shift of 3 apart: distance |mu|^2 = 9 (+ sampling noise)
    assert frechet_distance(a, rng.normal(size=(500, 4)) + [3, 0, 0, 0]) == pytest.approx(9, abs=0.8)
    with pytest.raises(ValueError, match="shapes"):
        frechet_distance(a, a[:, :3])


def test_feature_bank_holds_every_sequence_under_its_class_and_the_null_class(tiny, tmp_path):
    target = tiny["target_model"]
    tokens, labels = tiny["data"]["train"]
    tokens, labels, weights = tokens[:3], labels[:3], torch.tensor([0.5, 0.25, 0.25])
    bank = feature_bank(target, tokens, labels, weights, null_prob=0.1, bf16=False, cache=tmp_path / "bank.safetensors",
                        progress=False)
    assert torch.equal(bank.tokens, torch.cat([tokens, tokens]))
    null = torch.full_like(labels, TINY_GPT.null_class)
    for rows, cond in ((slice(0, 3), labels), (slice(3, 6), null)):
        expect = target_features(target, tokens, cond, bf16=False)
        torch.testing.assert_close(bank.hidden[rows].float(), expect, atol=2e-2, rtol=2e-2)  # stored in bf16
    torch.testing.assert_close(bank.weights, torch.cat([weights * 0.9, weights * 0.1]))
    # read back from its cache; another null share is not the same bank
    again = feature_bank(target, tokens, labels, weights, 0.1, False, cache=tmp_path / "bank.safetensors",
                         progress=False)
    assert torch.equal(again.hidden, bank.hidden)
    other = feature_bank(target, tokens, labels, weights, 0.2, False, cache=tmp_path / "bank.safetensors",
                         progress=False)
    torch.testing.assert_close(other.weights[3:], weights * 0.2)


def test_reusing_a_target_built_with_other_settings_is_refused(tmp_path):
    from dataclasses import replace

    from lantern.bundle import DEFAULT_BUNDLE
    from lantern.embedded.train.pipeline import PipelineSettings, reuse_target
    manifest = json.loads((DEFAULT_BUNDLE / "manifest.json").read_text())
    fields = {**manifest["settings"], "gpt": gpt_preset("GPT-lantern-digits"),
              "sampling_candidates": tuple(manifest["settings"]["sampling_candidates"])}
    settings = PipelineSettings(**fields)
    with pytest.raises(ValueError, match="target_steps"):
        reuse_target(tmp_path, DEFAULT_BUNDLE, replace(settings, target_steps=settings.target_steps + 1))
    reports = reuse_target(tmp_path, DEFAULT_BUNDLE, settings)
    assert reports["target"] == manifest["stages"]["target"] and (tmp_path / "target.safetensors").exists()
