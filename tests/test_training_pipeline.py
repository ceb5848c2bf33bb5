"""Retrain a tiny version of the embedded bundle's pipeline and check that every stage learns."""
import numpy as np
import pytest
import torch

from lantern.config import gpt_preset
from lantern.metrics import frechet_distance
from lantern.models.classifier import ClassifierConfig
from lantern.models.vq import VQConfig
from lantern.train.drafter import train_drafter
from lantern.train.evaluator import train_evaluator
from lantern.train.pipeline import load_target, load_vq
from lantern.train.sample import sample_ar_simple
from lantern.train.target import target_loss, train_target
from lantern.train.tokenizer import train_tokenizer
from lantern.train.tokens import token_dataset

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
    drafter_report = train_drafter(str(work), target, tokens, labels, data["heldout"], steps=30, batch=8,
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
    assert r["top1_agreement_cond"] > 5 / TINY_GPT.vocab_size, r
    assert 0 <= r["top1_agreement_uncond"] <= 1


def test_reference_sampler_gives_valid_codes(tiny):
    codes = sample_ar_simple(tiny["target_model"], torch.tensor([0, 3]), cfg_scale=2.0, top_k=8, seed=1)
    assert codes.shape == (2, TINY_GPT.block_size) and codes.dtype == torch.int64
    assert 0 <= int(codes.min()) and int(codes.max()) < TINY_GPT.vocab_size
    again = sample_ar_simple(tiny["target_model"], torch.tensor([0, 3]), cfg_scale=2.0, top_k=8, seed=1)
    assert torch.equal(codes, again)


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
