"""LANTERN's published drafters (EAGLE-style config.json + pytorch_model.bin, HF Llama key names) load as they are,
and lantern's drafter module computes the same logits as LANTERN's drafter architecture for the same target
states. The reference below is written from LANTERN's published description (models/drafters/cnets_llamagen.py):
fc(cat(embed_tokens(x_{t+1}), f_t)) -> one Llama decoder layer without the input RMSNorm, q/k/v apart, LlamaGen's 2D
RoPE over a table with 0 (c2i) or 119 (t2i) zero prefix rows, the pair (f_t, x_{t+1}) at position t (c2i) /
119 + t (t2i) -> the target's lm_head. In text-to-image LANTERN (models/ea_model_llamagen.py) feeds the drafter the
whole caption prefix too: the target's features at the 120 caption positions paired with token 0 (its input ids are
zero-padded), then the first image token, in one causal pass with no caption mask."""
from __future__ import annotations

import json
import math

import pytest
import torch

from lantern.models.config import GPTConfig
from lantern.models.llamagen import read_lantern_drafter
from lantern.models.drafter import prefix_pairs
from lantern.models.gpt import GPT

from engine_recording import first_step_seen
from test_llamagen_import import write_lantern_drafter

HIDDEN, HEADS, VOCAB = 64, 4, 64


def reference_rope(grid: int, head_dim: int, prefix: int, base: float = 10000.0) -> torch.Tensor:
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    f = torch.outer(torch.arange(grid).float(), freqs)
    rows = torch.cat([f[:, None, :].expand(-1, grid, -1), f[None, :, :].expand(grid, -1, -1)], -1)
    table = torch.stack([rows.cos(), rows.sin()], -1).flatten(0, 1)
    return torch.cat([torch.zeros(prefix, half, 2), table, torch.zeros(10, half, 2)])


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, hd), rope (T, hd/2, 2): each (even, odd) pair rotated."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    c, s = rope[None, :, None, :, 0], rope[None, :, None, :, 1]
    return torch.stack([xs[..., 0] * c - xs[..., 1] * s, xs[..., 1] * c + xs[..., 0] * s], -1).flatten(3)


def rms(x, w, eps):
    return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps))


def reference_drafter(state: dict, conf: dict, features: torch.Tensor, next_tokens: torch.Tensor, start: int,
                      lm_head: torch.Tensor, positions=None, allowed=None) -> tuple[torch.Tensor, torch.Tensor]:
    """LANTERN's drafter over pairs (features (B, T, D), next_tokens (B, T)) at its positions start .. start + T - 1
    (or `positions` (T,)), causal (or attending by `allowed` (T, T) bool: a tree's rows see the prefix and
    themselves). Returns (logits (B, T, V), predicted features (B, T, D))."""
    prefix, block = {"c2i": (0, 576), "t2i": (119, 256), "t2i2": (119, 1024)}[conf["input_type"]]
    B, T, D = features.shape
    H = conf["num_attention_heads"]
    hd = D // H
    positions = start + torch.arange(T) if positions is None else positions
    allowed = torch.ones(T, T, dtype=torch.bool).tril() if allowed is None else allowed
    table = reference_rope(int(math.isqrt(block)), hd, prefix)[positions]
    x = torch.cat([state["embed_tokens.weight"][next_tokens], features], -1) @ state["fc.weight"].T + state["fc.bias"]
    p = "layers.0.self_attn."
    q = rotate((x @ state[p + "q_proj.weight"].T).view(B, T, H, hd), table).transpose(1, 2)
    k = rotate((x @ state[p + "k_proj.weight"].T).view(B, T, H, hd), table).transpose(1, 2)
    v = (x @ state[p + "v_proj.weight"].T).view(B, T, H, hd).transpose(1, 2)
    scores = q @ k.transpose(2, 3) / math.sqrt(hd)
    scores = scores.masked_fill(~allowed, float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)
    h = x + att @ state[p + "o_proj.weight"].T
    m = "layers.0.mlp."
    n = rms(h, state["layers.0.post_attention_layernorm.weight"], conf["rms_norm_eps"])
    mlp = (torch.nn.functional.silu(n @ state[m + "gate_proj.weight"].T) * (n @ state[m + "up_proj.weight"].T))
    out = h + mlp @ state[m + "down_proj.weight"].T
    return out @ lm_head.T, out


@pytest.mark.parametrize("input_type,model_type,block,prefix", [("c2i", "c2i", 576, 1), ("t2i", "t2i", 256, 120)])
def test_lantern_drafter_logits_match_the_reference(tmp_path, input_type, model_type, block, prefix):
    extra = dict(num_classes=4) if model_type == "c2i" else dict(caption_dim=32)
    cfg = GPTConfig(dim=HIDDEN, n_layer=1, n_head=HEADS, vocab_size=VOCAB, block_size=block, multiple_of=32,
                    model_type=model_type, cls_token_num=prefix, **extra)
    torch.manual_seed(0)
    target = GPT(cfg).eval()
    state = write_lantern_drafter(tmp_path / "d", HIDDEN, HEADS, VOCAB, input_type, seed=1)
    conf = json.loads((tmp_path / "d" / "config.json").read_text())
    drafter = read_lantern_drafter(tmp_path / "d", cfg)
    assert not drafter.options.input_norm and drafter.options.own_embedding and drafter.options.reads_prefix
    assert prefix_pairs(drafter, cfg) == prefix - 1  # c2i: none; t2i: the caption's first 119 positions
    B, T = 2, 7
    first = math.isqrt(block) - 4  # pairs for image tokens first+1 .. first+T, across a grid row's end
    feats = torch.randn(B, T, HIDDEN)
    tokens = torch.randint(0, VOCAB, (B, T))
    positions = (prefix + first + 1 + torch.arange(T))[None].expand(B, -1)  # lantern: x_{t+1}'s position
    with torch.no_grad():
        ours = target.head(drafter(target, tokens, feats, positions))
        ref = reference_drafter(state, conf, feats, tokens, prefix - 1 + first + 1, target.output.weight)[0]
    assert (ours - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())
    # and the check is sensitive to the convention: LANTERN's position index read in lantern's table is off by one
    with torch.no_grad():
        off = target.head(drafter(target, tokens, feats, positions - 1))
    assert (off - ref).abs().max() > 1e-3


def test_lantern_drafter_for_another_grid_is_refused(tmp_path):
    cfg = GPTConfig(dim=HIDDEN, n_layer=1, n_head=HEADS, vocab_size=VOCAB, block_size=256, multiple_of=32,
                    model_type="t2i", cls_token_num=120, caption_dim=32)
    write_lantern_drafter(tmp_path / "d", HIDDEN, HEADS, VOCAB, "t2i2", seed=1)
    with pytest.raises(ValueError, match="t2i2.*1024 image tokens.*256"):
        read_lantern_drafter(tmp_path / "d", cfg)


def test_imported_t2i_bundle_with_a_lantern_drafter_runs_every_method(tmp_path):
    """LlamaGen t2i GPT (256 image tokens) + VQ + LANTERN's t2i drafter folder + a codebook table -> a bundle whose
    greedy tokens are the same with AR and EAGLE-2 (lossless), with a padded caption (LlamaGen's mask)."""
    import argparse as ap

    from lantern.api import Pipeline
    from lantern.bundle import load_bundle
    from lantern.cli import main
    from lantern.decoding import SamplingConfig, method_preset
    from lantern.models.vq import VQConfig, VQModel

    cfg = GPTConfig(dim=HIDDEN, n_layer=1, n_head=HEADS, vocab_size=VOCAB, block_size=256, multiple_of=192,
                    model_type="t2i", cls_token_num=120, caption_dim=32)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    with torch.no_grad():
        gpt.output.weight.mul_(20)  # peaked distributions, as a trained model's
    torch.save({"model": gpt.state_dict(), "args": ap.Namespace(image_size=32)}, tmp_path / "t2i.pt")
    vq_cfg = VQConfig(codebook_size=VOCAB, codebook_embed_dim=8, ch=32, ch_mult=(1, 2), num_res_blocks=1,
                      z_channels=32, image_size=32)
    torch.save({"model": dict(VQModel(vq_cfg).state_dict(), **{"quantize.codebook_used": torch.zeros(8)})},
               tmp_path / "vq.pt")
    write_lantern_drafter(tmp_path / "drafter", HIDDEN, HEADS, VOCAB, "t2i", seed=2)
    assert main(["import", "--gpt", str(tmp_path / "t2i.pt"), "--vq", str(tmp_path / "vq.pt"), "--heads", str(HEADS),
                 "--image-size", "32", "--drafter", str(tmp_path / "drafter"), "--proximity", "codebook",
                 "--proximity-k", "16", "--out", str(tmp_path / "b"), "--json"]) == 0
    b = load_bundle(tmp_path / "b")
    assert not b.drafter.options.input_norm and b.drafter.options.own_embedding
    assert b.config["drafter"]["caption_mask"] == "lantern" and b.drafter.caption_mask == "lantern"  # recorded
    captions = torch.randn(1, 120, 32)
    captions[0, :100] = 0  # LlamaGen's layout: padding first, zeroed
    pipe = Pipeline.from_bundle(b, backend="cpu")
    sampling = SamplingConfig(greedy=True, cfg_scale=7.5)
    ar = pipe.generate(captions, method_preset("ar", sampling)).tokens
    assert torch.equal(pipe.generate(captions, method_preset("eagle2", sampling)).tokens, ar)


def t2i_engine_drafts(target, drafter, captions):
    """One engine step of EAGLE-2 (greedy, CFG) on the cpu backend for one caption -> the prefill's features
    (R, P, D) and every drafter call's (inputs, logits) in order."""
    from lantern.api import Pipeline
    from lantern.decoding import SamplingConfig, method_preset
    from lantern.engine import Engine

    pipe = Pipeline(target, drafter, backend="cpu")
    engine = Engine(pipe, method_preset("eagle2", SamplingConfig(greedy=True, cfg_scale=7.5)), 1)
    return first_step_seen(engine, captions[0])


def test_lantern_t2i_drafter_reads_the_caption_prefix_as_lantern_feeds_it(tmp_path):
    """Through the engine (prefill, catch-up, EAGLE-2's first tree level), a LANTERN t2i drafter's logits equal the
    reference fed as LANTERN feeds it: the 120 caption positions' target features with token 0 and then the first
    image token in one causal pass (no caption mask), the tree's nodes after it. Without the prefix they differ."""
    import dataclasses

    from lantern.models.drafter import Drafter

    cfg = GPTConfig(dim=HIDDEN, n_layer=1, n_head=HEADS, vocab_size=VOCAB, block_size=256, multiple_of=32,
                    model_type="t2i", cls_token_num=120, caption_dim=32)
    torch.manual_seed(0)
    target = GPT(cfg).eval()
    state = write_lantern_drafter(tmp_path / "d", HIDDEN, HEADS, VOCAB, "t2i", seed=1)
    conf = json.loads((tmp_path / "d" / "config.json").read_text())
    drafter = read_lantern_drafter(tmp_path / "d", cfg)
    captions = torch.randn(1, 120, 32)
    captions[0, :100] = 0  # LlamaGen's layout: padding first (masked in the target, not in LANTERN's drafter)
    seen = t2i_engine_drafts(target, drafter, captions)
    (prefix_in, _), (catch_in, catch_logits), (tree_in, tree_logits) = seen["drafts"][:3]
    assert prefix_in[0].shape[1] == 119 and not prefix_in[0].any()  # the prefix pairs carry token 0
    feats = seen["features"]  # (2, 120, D): the cond and null-caption rows
    root = catch_in[0][:, :1]  # (2, 1) the first image token, both rows
    seq_feats = feats
    seq_tokens = torch.cat([torch.zeros(2, 119, dtype=torch.long), root], 1)
    with torch.no_grad():
        ref_logits, ref_out = reference_drafter(state, conf, seq_feats, seq_tokens, 0, target.output.weight)
        assert (catch_logits[:, 0] - ref_logits[:, -1]).abs().max() <= 1e-4 * max(1.0, ref_logits.abs().max().item())
        # the first tree level: k nodes at LANTERN's position 120, each seeing the 120 pairs and itself
        k = tree_in[0].shape[1]
        allowed = torch.zeros(120 + k, 120 + k, dtype=torch.bool)
        allowed[:120, :120] = torch.ones(120, 120, dtype=torch.bool).tril()
        allowed[120:, :120] = True
        allowed[120:, 120:] = torch.eye(k, dtype=torch.bool)
        all_feats = torch.cat([seq_feats, ref_out[:, -1:].expand(-1, k, -1)], 1)
        all_tokens = torch.cat([seq_tokens, tree_in[0]], 1)
        positions = torch.cat([torch.arange(120), torch.full((k,), 120)])
        ref_tree = reference_drafter(state, conf, all_feats, all_tokens, 0, target.output.weight, positions,
                                     allowed)[0][:, 120:]
    assert (tree_logits - ref_tree).abs().max() <= 1e-4 * max(1.0, ref_tree.abs().max().item())
    # the check is sensitive to the prefix: the same weights starting at the first image token draft otherwise
    alone = Drafter(cfg, dataclasses.replace(drafter.options, reads_prefix=False))
    alone.load_state_dict(drafter.state_dict())
    seen_alone = t2i_engine_drafts(target, alone.eval(), captions)
    assert seen_alone["drafts"][0][0][0].shape[1] != 119  # no prefix step
    assert (seen_alone["drafts"][0][1][:, 0] - ref_logits[:, -1]).abs().max() > 1e-3


def test_static_spec_prefix_draft_step():
    from lantern.backends.base import StaticSpec
    spec = StaticSpec(batch=2, max_len=512, prefix_len=120, verify_widths=(1,), draft_widths=(4, 119),
                      draft_prefix=119)
    assert spec.draft_first_slot == 1 and "draft[119]" in spec.static_steps
    plain = StaticSpec(batch=2, max_len=512, prefix_len=120, verify_widths=(1,), draft_widths=(4,))
    assert plain.draft_first_slot == 120  # lantern's drafters start at the first image token
    for bad in (dict(draft_widths=(4,), draft_prefix=119), dict(draft_widths=(4, 120), draft_prefix=120)):
        with pytest.raises(ValueError, match="draft_prefix"):
            StaticSpec(batch=2, max_len=512, prefix_len=120, verify_widths=(1,), **bad)
