"""Function-preserving inflation (lantern.models.inflate): the inflated target and drafter compute the small
models' logits over the real vocabulary, and every method generates the small model's tokens at the same seed."""
import pytest
import torch

from lantern.api import Pipeline
from lantern.decoding import SamplingConfig, method_preset
from lantern.models.inflate import inflate_models, inflate_proximity, inflated_config, preset_config

# GPT-test (dim 64, 4 heads of 16, 2 layers, 64 codes) widened, deepened and its vocabulary padded
SHAPE = dict(dim=128, n_layer=3, vocab_size=160, multiple_of=32)


@pytest.fixture(scope="module")
def pair(tiny):
    target, drafter, proximity = tiny
    return (target, drafter, proximity), inflate_models(target, drafter, proximity,
                                                        inflated_config(target.config, **SHAPE))


def test_inflated_shape_is_the_one_asked_for(pair):
    (target, _, _), big = pair
    cfg = big.target.config
    assert (cfg.dim, cfg.n_layer, cfg.vocab_size, cfg.head_dim) == (128, 3, 160, target.config.head_dim)
    assert cfg.n_head == 8 and cfg.ffn_hidden >= target.config.ffn_hidden


@torch.no_grad()
def test_logits_and_features_match_over_the_real_vocabulary(pair):
    (target, drafter, _), big = pair
    v0, d0 = target.config.vocab_size, target.config.dim
    g = torch.Generator().manual_seed(0)
    tokens, cond = torch.randint(v0, (3, 12), generator=g), torch.tensor([0, 2, target.config.null_class])
    small_logits, small_hidden = target.forward_full(tokens, cond)
    big_logits, big_hidden = big.target.forward_full(tokens, cond)
    assert torch.allclose(big_logits[..., :v0], small_logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(big_hidden[..., :d0], small_hidden, atol=1e-4, rtol=1e-4)
    # padded codes: far below every real logit, so no sampling rule ever reaches them
    assert big_logits[..., v0:].max() < small_logits.min() - 100
    positions = torch.arange(1, 13)[None].expand(3, -1)
    small_draft = target.head(drafter(target, tokens, small_hidden[:, 1:], positions))
    big_draft = big.target.head(big.drafter(big.target, tokens, big_hidden[:, 1:], positions))
    assert torch.allclose(big_draft[..., :v0], small_draft, atol=1e-4, rtol=1e-4)
    assert big_draft[..., v0:].max() < small_draft.min() - 100


# Greedy: every method; sampled over a top-k support: the same random stream sees the same support. (MC-SJD's
# Gumbel noise is drawn over the whole vocabulary, so it is equal only in distribution.)
CASES = [("ar", True), ("eagle2", True), ("lantern++", True), ("sjd", True), ("ar", False), ("eagle2", False),
         ("lantern++", False)]


@pytest.mark.parametrize("method,greedy", CASES)
def test_inflated_model_generates_the_small_models_tokens(pair, method, greedy):
    (target, drafter, proximity), big = pair
    sampling = SamplingConfig(greedy=greedy, top_k=0 if greedy else 8, cfg_scale=2.0)
    dcfg = method_preset(method, sampling, **({"window": 4} if method == "sjd" else {}))
    small = Pipeline(target, drafter, proximity, backend="cpu").generate([0, 1, 3], dcfg, seed=5)
    large = Pipeline(big.target, big.drafter, big.proximity, backend="cpu").generate([0, 1, 3], dcfg, seed=5)
    assert torch.equal(small.tokens, large.tokens)
    assert int(large.tokens.max()) < big.real_vocab


def test_jacobi_on_the_inflated_model_never_emits_a_padded_code(pair):
    _, big = pair
    dcfg = method_preset("mc-sjd-relaxed", SamplingConfig(top_k=8, cfg_scale=2.0), window=4)
    out = Pipeline(big.target, big.drafter, big.proximity, backend="cpu").generate([0, 1], dcfg, seed=1)
    assert int(out.tokens.max()) < big.real_vocab


def test_padded_proximity_rows_are_distinct_padded_codes(tiny):
    proximity = tiny[2]
    padded = inflate_proximity(proximity, 160)
    assert torch.equal(padded[:64], proximity)
    rows = padded[64:]
    assert int(rows.min()) >= 64 and int(rows.max()) < 160
    assert all(len(set(r.tolist())) == r.numel() and i + 64 not in r.tolist() for i, r in enumerate(rows))


def test_unreachable_shapes_are_refused(tiny):
    cfg = tiny[0].config
    with pytest.raises(ValueError, match="multiple of head_dim"):
        inflated_config(cfg, dim=100, n_layer=3, vocab_size=96)
    with pytest.raises(ValueError, match="depth"):
        inflated_config(cfg, dim=128, n_layer=1, vocab_size=96)
    with pytest.raises(ValueError, match="vocabulary"):
        inflated_config(cfg, dim=128, n_layer=3, vocab_size=64)
    with pytest.raises(ValueError, match="unknown inflation shape"):
        preset_config(cfg, "GPT-Z")
    with pytest.raises(ValueError, match="padded codes"):
        inflate_proximity(tiny[2], 70)


def test_named_shapes_have_llamagen_compute():
    from lantern.models.config import gpt_preset
    small = gpt_preset("GPT-lantern-digits")
    b, l = preset_config(small, "GPT-B"), preset_config(small, "GPT-L")
    assert (b.dim, b.n_layer, b.vocab_size, b.ffn_hidden) == (768, 12, 16384, 2048)
    assert (l.dim, l.n_layer, l.vocab_size, l.ffn_hidden) == (1024, 24, 16384, 2816)
