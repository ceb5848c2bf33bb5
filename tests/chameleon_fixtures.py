"""Tiny random Chameleon / Anole folders, built offline: config with its vocabulary map, weights (save_pretrained), a
word-level tokenizer, and a taming-format VQGAN (vqgan.yaml + vqgan.ckpt) in <folder>/tokenizer."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<s>", "<pad>", "</s>", "<reserved08706>", "<racm3:break>", "<eoss>", "<image>"]
WORDS = ["a", "red", "cat", "on", "the", "mat", "blue", "dog"]
BOS, PAD, EOT, BOI = 0, 1, 3, 4


def digits_name(code: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def vocabulary(codes: int) -> dict:
    """Specials, words, then the image tokens in name order (as in Chameleon's vocabulary, so code order and BPE
    order differ: IMGIMGBAZ, code 10, comes before IMGIMGCZ, code 2)."""
    names = SPECIALS + WORDS + sorted(digits_name(c) for c in range(codes))
    return {name: i for i, name in enumerate(names)}


def vqgan_ddconfig(grid: int) -> dict:
    return dict(double_z=False, z_channels=32, resolution=4 * grid, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 2, 2],
                num_res_blocks=1, attn_resolutions=[grid], dropout=0.0)


def chameleon_config(codes: int = 24, grid: int = 4, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, swin_norm: bool = False):
    vocab = vocabulary(codes)
    dd = vqgan_ddconfig(grid)
    return transformers.ChameleonConfig(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256, bos_token_id=BOS,
        pad_token_id=PAD, eos_token_id=2, swin_norm=swin_norm, vocabulary_map=vocab,
        vq_config=dict(embed_dim=8, num_embeddings=codes, latent_channels=dd["z_channels"],
                       resolution=dd["resolution"], base_channels=32, channel_multiplier=dd["ch_mult"],
                       num_res_blocks=1, attn_resolutions=[]))


def sharpen_(model, std: float, seed: int) -> None:
    """Re-draw the language model's weights with a larger spread, so logits are far from flat (greedy parity then
    tests real choices, not ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.vqmodel"):
                continue
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))


def write_tokenizer(folder: Path, vocab: dict) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.save_pretrained(folder)


def write_vqgan(folder: Path, codes: int, grid: int, seed: int = 0) -> dict:
    """A random taming-format VQGAN: vqgan.yaml and vqgan.ckpt (a Lightning-style {"state_dict": ...} with encoder
    and loss weights beside the decoder's, as the real file has). Returns the state dict."""
    from lantern.models.vqgan import VQGANDecoder
    torch.manual_seed(seed)
    dd = vqgan_ddconfig(grid)
    state = VQGANDecoder(codes, 8, dd).state_dict()
    gen = torch.Generator().manual_seed(seed)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}  # norms off identity
    state["encoder.conv_in.weight"] = torch.randn(32, 3, 3, 3)
    state["loss.logvar"] = torch.zeros(())
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state, "global_step": 0}, folder / "vqgan.ckpt")
    params = {"embed_dim": 8, "n_embed": codes, "ddconfig": dd, "lossconfig": {"target": "taming.Loss"}}
    (folder / "vqgan.yaml").write_text(yaml.safe_dump({"model": {"target": "taming.models.vqgan.VQModel",
                                                                 "params": params}}))
    return state


def make_chameleon_folder(folder: Path, seed: int = 0, std: float = 0.3, vq: bool = True, **config):
    """Save a tiny random Chameleon model, a word-level tokenizer and (vq) its VQGAN to `folder`."""
    torch.manual_seed(seed)
    cfg = chameleon_config(**config)
    model = transformers.ChameleonForConditionalGeneration(cfg).eval()
    sharpen_(model, std, seed)
    model.save_pretrained(folder)
    write_tokenizer(folder, cfg.vocabulary_map)
    if vq:
        write_vqgan(folder / "tokenizer", cfg.vq_config.num_embeddings, config.get("grid", 4), seed)
    return model


def write_anole_drafter(folder: Path, model, seed: int = 0, std: float = 0.3, **conf_overrides) -> dict:
    """A random drafter in LANTERN's Anole format for `model` (a ChameleonForConditionalGeneration): config.json and
    model.safetensors with embed_tokens, fc (with bias) and layers.0.* under transformers' Chameleon names."""
    from safetensors.torch import save_file
    cfg = model.config
    d, h, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, ffn = d // h, cfg.intermediate_size
    shapes = {"embed_tokens.weight": (cfg.vocab_size, d), "fc.weight": (d, 2 * d), "fc.bias": (d,),
              "layers.0.self_attn.q_proj.weight": (h * hd, d), "layers.0.self_attn.k_proj.weight": (kv * hd, d),
              "layers.0.self_attn.v_proj.weight": (kv * hd, d), "layers.0.self_attn.o_proj.weight": (d, d),
              "layers.0.self_attn.q_norm.weight": (h, hd), "layers.0.self_attn.q_norm.bias": (h, hd),
              "layers.0.self_attn.k_norm.weight": (kv, hd), "layers.0.self_attn.k_norm.bias": (kv, hd),
              "layers.0.mlp.gate_proj.weight": (ffn, d), "layers.0.mlp.up_proj.weight": (ffn, d),
              "layers.0.mlp.down_proj.weight": (d, ffn), "layers.0.input_layernorm.weight": (d,),
              "layers.0.post_attention_layernorm.weight": (d,)}
    gen = torch.Generator().manual_seed(seed)
    state = {k: (1.0 if "norm.weight" in k or "layernorm" in k else 0.0) + std * torch.randn(s, generator=gen)
             for k, s in shapes.items()}
    state["embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()  # as LANTERN trains it
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    conf = {"model_type": "chameleon", "architectures": ["ChameleonForConditionalGeneration"], "num_hidden_layers": 1,
            "hidden_size": d, "num_attention_heads": h, "num_key_value_heads": kv, "intermediate_size": ffn,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu", "bias": True,
            "swin_norm": False, **conf_overrides}
    (folder / "config.json").write_text(__import__("json").dumps(conf))
    return state
