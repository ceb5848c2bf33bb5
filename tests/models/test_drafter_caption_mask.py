"""Drafters are fed the caption features they were trained with, at padded caption slots too.

The references here are written from the two projects' code, not from lantern's:
- LANTERN (models/ea_model_llamagen.py `generate`, models/kv_variants/modeling_llamagen_kv.py): the caption is
  left-padded and its padded slots zeroed, the null caption row gets the caption's mask too, and the prefill's
  attention adds `_make_causal_mask` (float32 minimum above the diagonal) to `_expand_mask` (the minimum of the
  model's dtype, bf16 by default, at padded key slots), then takes an fp32 softmax; its drafter reads the final
  normed features of all 120 caption slots.
- LlamaGen (autoregressive/models/generate.py): the causal mask's caption columns times the caption mask, with
  the diagonal set back to 1.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from lantern.engine.caption_mask import CaptionMaskedRunner, drafter_caption_mask
from lantern.models.config import GPTConfig
from lantern.models.llamagen import read_lantern_drafter
from lantern.models.drafter import Drafter, DrafterOptions
from lantern.models.gpt import GPT

from test_lantern_drafter import reference_drafter, reference_rope, rms, rotate, t2i_engine_drafts
from test_llamagen_import import write_lantern_drafter

HIDDEN, HEADS, VOCAB, CAPTION = 64, 4, 64, 32
PADDED = 100  # padded slots of the 120: the caption's 20 tokens come last (LlamaGen's layout)


def lantern_additive_mask(emb_mask: torch.Tensor, mask_dtype: torch.dtype) -> torch.Tensor:
    """LANTERN's prefill mask for (rows, T) 0/1 caption masks -> (rows, 1, T, T) float32, summed as its code sums
    a float32 causal mask and a padding mask in the model's dtype."""
    rows, t = emb_mask.shape
    causal = torch.full((t, t), torch.finfo(torch.float32).min)
    causal.masked_fill_(torch.arange(t) < (torch.arange(t) + 1)[:, None], 0.0)
    inverted = 1.0 - emb_mask[:, None, None, :].expand(rows, 1, t, t).to(mask_dtype)
    padding = inverted.masked_fill(inverted.to(torch.bool), torch.finfo(mask_dtype).min)
    return padding + causal[None, None]  # bf16 + float32 -> float32 (the minimums add to -inf)


def llamagen_bool_mask(emb_mask: torch.Tensor) -> torch.Tensor:
    """LlamaGen's prefill mask for (rows, T) caption masks -> (rows, 1, T, T) bool."""
    t = emb_mask.shape[1]
    causal = torch.ones(t, t).tril()[None] * emb_mask[:, None, :].float()
    eye = torch.eye(t)
    return (causal * (1 - eye) + eye).bool()[:, None]


def reference_caption_features(state: dict, cfg: GPTConfig, rows: torch.Tensor, emb_mask: torch.Tensor,
                               convention: str) -> torch.Tensor:
    """A LlamaGen t2i GPT's final normed features over the caption rows (rows, T, C), computed as LANTERN
    ("lantern", at bf16 mask arithmetic) or LlamaGen ("llamagen") does. -> (rows, T, D)."""
    t, hd = rows.shape[1], HIDDEN // HEADS
    x = rows @ state["cls_embedding.cap_proj.fc1.weight"].T
    x = torch.nn.functional.gelu(x, approximate="tanh") @ state["cls_embedding.cap_proj.fc2.weight"].T
    rope = reference_rope(cfg.grid_size, hd, cfg.cls_token_num)[:t]  # zero rows over the caption
    if convention == "lantern":
        add = lantern_additive_mask(emb_mask, torch.bfloat16)
    else:
        add = torch.zeros(llamagen_bool_mask(emb_mask).shape).masked_fill(~llamagen_bool_mask(emb_mask), -math.inf)
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        n = rms(x, state[p + "attention_norm.weight"], cfg.norm_eps)
        q, k, v = (n @ state[p + "attention.wqkv.weight"].T).split(HIDDEN, -1)
        q = rotate(q.view(-1, t, HEADS, hd), rope).transpose(1, 2)
        k = rotate(k.view(-1, t, HEADS, hd), rope).transpose(1, 2)
        v = v.view(-1, t, HEADS, hd).transpose(1, 2)
        scores = q @ k.transpose(2, 3) / math.sqrt(hd) + add
        h = x + (scores.softmax(-1, dtype=torch.float32) @ v).transpose(1, 2).reshape(-1, t, HIDDEN) @ \
            state[p + "attention.wo.weight"].T
        n = rms(h, state[p + "ffn_norm.weight"], cfg.norm_eps)
        gate = torch.nn.functional.silu(n @ state[p + "feed_forward.w1.weight"].T)
        x = h + (gate * (n @ state[p + "feed_forward.w3.weight"].T)) @ state[p + "feed_forward.w2.weight"].T
    return rms(x, state["norm.weight"], cfg.norm_eps)


def t2i_target() -> GPT:
    cfg = GPTConfig(dim=HIDDEN, n_layer=2, n_head=HEADS, vocab_size=VOCAB, block_size=256, multiple_of=32,
                    model_type="t2i", cls_token_num=120, caption_dim=CAPTION)
    torch.manual_seed(0)
    return GPT(cfg).eval()


def padded_caption() -> tuple[torch.Tensor, torch.Tensor]:
    """One caption in LlamaGen's layout (padding first, zeroed) and its 0/1 mask (1, 120)."""
    g = torch.Generator().manual_seed(3)
    caption = torch.randn(1, 120, CAPTION, generator=g)
    caption[0, :PADDED] = 0
    mask = torch.zeros(1, 120)
    mask[0, PADDED:] = 1
    return caption, mask


def test_the_two_references_differ_only_at_padded_slots_of_the_null_caption():
    """What the conventions change: the features at the null-caption row's padded slots (the conditional row's
    padded inputs are zero under both); the valid slots, whose features decide every output, agree."""
    target = t2i_target()
    caption, mask = padded_caption()
    rows = torch.cat([caption, target.null_condition(1)])
    masks = torch.cat([mask, mask])
    state = target.state_dict()
    with torch.no_grad():
        ours = reference_caption_features(state, target.config, rows, masks, "lantern")
        theirs = reference_caption_features(state, target.config, rows, masks, "llamagen")
    assert (ours[:, PADDED:] - theirs[:, PADDED:]).abs().max() <= 1e-5
    assert (ours[0] - theirs[0]).abs().max() <= 1e-5
    assert (ours[1, 1:PADDED] - theirs[1, 1:PADDED]).abs().max() > 0.1  # slot 0 sees only itself under both


def test_lantern_t2i_drafter_is_fed_lantern_caption_features(tmp_path):
    """Through the engine, on a padded caption: the features a LANTERN t2i drafter reads over the caption prefix,
    its first draft (catch-up) logits and its first EAGLE-2 tree level equal the reference fed as LANTERN
    feeds it."""
    target = t2i_target()
    state = write_lantern_drafter(tmp_path / "d", HIDDEN, HEADS, VOCAB, "t2i", seed=1)
    conf = json.loads((tmp_path / "d" / "config.json").read_text())
    drafter = read_lantern_drafter(tmp_path / "d", target.config)
    assert drafter.caption_mask == "lantern"
    caption, mask = padded_caption()
    seen = t2i_engine_drafts(target, drafter, caption)
    (prefix_in, _), (catch_in, catch_logits), (tree_in, tree_logits) = seen["drafts"][:3]
    rows = torch.cat([caption, target.null_condition(1)])
    with torch.no_grad():
        feats = reference_caption_features(target.state_dict(), target.config, rows, torch.cat([mask, mask]),
                                           "lantern")  # (2, 120, D)
    assert (prefix_in[1] - feats[:, :119]).abs().max() <= 1e-4 * max(1.0, feats.abs().max().item())
    tokens = torch.cat([torch.zeros(2, 119, dtype=torch.long), catch_in[0][:, :1]], 1)
    with torch.no_grad():
        ref_logits, ref_out = reference_drafter(state, conf, feats, tokens, 0, target.output.weight)
    scale = max(1.0, ref_logits.abs().max().item())
    assert (catch_logits[:, 0] - ref_logits[:, -1]).abs().max() <= 1e-4 * scale
    k = tree_in[0].shape[1]  # the first tree level: k nodes at position 120, each seeing the prefix and itself
    allowed = torch.zeros(120 + k, 120 + k, dtype=torch.bool)
    allowed[:120, :120] = torch.ones(120, 120, dtype=torch.bool).tril()
    allowed[120:, :120] = True
    allowed[120:, 120:] = torch.eye(k, dtype=torch.bool)
    with torch.no_grad():
        ref_tree = reference_drafter(state, conf, torch.cat([feats, ref_out[:, -1:].expand(-1, k, -1)], 1),
                                     torch.cat([tokens, tree_in[0]], 1), 0, target.output.weight,
                                     torch.cat([torch.arange(120), torch.full((k,), 120)]), allowed)[0][:, 120:]
    assert (tree_logits - ref_tree).abs().max() <= 1e-4 * max(1.0, ref_tree.abs().max().item())


def test_a_drafter_recording_llamagen_caption_mask_reads_llamagen_features(tmp_path):
    """The same LANTERN weights recorded as expecting LlamaGen's mask read LlamaGen's features: the convention
    is the drafter's, and the engine's prefill follows it."""
    target = t2i_target()
    write_lantern_drafter(tmp_path / "d", HIDDEN, HEADS, VOCAB, "t2i", seed=1)
    lantern = read_lantern_drafter(tmp_path / "d", target.config)
    other = Drafter(target.config, dataclasses.replace(lantern.options, caption_mask="llamagen"))
    other.load_state_dict(lantern.state_dict())
    caption, mask = padded_caption()
    prefix_feats = t2i_engine_drafts(target, other.eval(), caption)["drafts"][0][0][1]
    rows = torch.cat([caption, target.null_condition(1)])
    with torch.no_grad():
        feats = reference_caption_features(target.state_dict(), target.config, rows, torch.cat([mask, mask]),
                                           "llamagen")
    assert (prefix_feats - feats[:, :119]).abs().max() <= 1e-4 * max(1.0, feats.abs().max().item())


@pytest.mark.slow
def test_outputs_are_the_same_under_either_caption_mask(tmp_path):
    """The caption mask only changes what the drafter reads: greedy EAGLE-2 tokens with a LANTERN drafter equal
    AR's on a padded caption, whichever convention the drafter records."""
    from lantern.api import Pipeline
    from lantern.decoding import SamplingConfig, method_preset

    target = t2i_target()
    with torch.no_grad():
        target.output.weight.mul_(20)  # peaked distributions, as a trained model's
    write_lantern_drafter(tmp_path / "d", HIDDEN, HEADS, VOCAB, "t2i", seed=1)
    lantern = read_lantern_drafter(tmp_path / "d", target.config)
    other = Drafter(target.config, dataclasses.replace(lantern.options, caption_mask="llamagen"))
    other.load_state_dict(lantern.state_dict())
    caption, _ = padded_caption()
    sampling = SamplingConfig(greedy=True, cfg_scale=7.5)
    ar = Pipeline(target, None, backend="cpu").generate(caption, method_preset("ar", sampling)).tokens
    for drafter in (lantern, other.eval()):
        pipe = Pipeline(target, drafter, backend="cpu")
        assert torch.equal(pipe.generate(caption, method_preset("eagle2", sampling)).tokens, ar)


def test_which_caption_mask_a_drafter_expects():
    cfg = t2i_target().config
    assert drafter_caption_mask(None) == "llamagen"
    assert Drafter(cfg).caption_mask == "llamagen"  # lantern's own
    # options written before the field existed: LANTERN's layout (reads the prefix) means LANTERN's mask
    old = DrafterOptions.from_dict({"input_norm": False, "own_embedding": True, "reads_prefix": True})
    assert Drafter(cfg, old).caption_mask == "lantern"
    assert Drafter(cfg, DrafterOptions(reads_prefix=True, caption_mask="llamagen")).caption_mask == "llamagen"
    with pytest.raises(ValueError, match="caption mask 'hf'; allowed: llamagen, lantern"):
        DrafterOptions(caption_mask="hf")


def test_caption_masked_runner_refuses_an_unknown_convention():
    class Spec:
        max_len = 8

    class Runner:
        spec, device = Spec(), torch.device("cpu")

    with pytest.raises(ValueError, match="caption mask 'fp32'; allowed"):
        CaptionMaskedRunner(Runner(), torch.ones(1, 4, dtype=torch.bool), "fp32")
