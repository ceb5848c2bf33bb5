"""Tiny random Janus folders, built offline: config, weights (save_pretrained), generation config, tokenizer."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["<pad>", "<bos>", "<eos>", "<begin_of_image>", "a", "red", "cat", "on", "the", "mat", "blue", "dog"]
PAD, BOS, EOS, BOI = 0, 1, 2, 3


def janus_config(vocab: int = 48, grid: int = 4, hidden: int = 64, layers: int = 2, heads: int = 4,
                 kv_heads: int = 2):
    """A JanusConfig with an image grid of grid x grid tokens over a VQ codebook of `vocab` entries."""
    patch = 8
    return transformers.JanusConfig(
        text_config=dict(model_type="llama", hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         vocab_size=len(WORDS) + 4, max_position_embeddings=256),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=grid * patch,
                           patch_size=patch, num_image_tokens=grid * grid, projection_dim=hidden, depth=1),
        vq_config=dict(embed_dim=8, num_embeddings=vocab, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 2], num_res_blocks=1, projection_dim=hidden,
                       image_token_embed_dim=hidden),
        image_token_id=len(WORDS) + 3)


def sharpen_(model, std: float = 0.3, seed: int = 0) -> None:
    """Re-draw every weight of the language model and generation path with a larger spread, so logits are far
    from flat (greedy parity then tests real choices, not ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.vision_model") or name.startswith("model.vqmodel"):
                continue
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                                pad_token="<pad>")
    fast.save_pretrained(folder)


def make_janus_folder(folder: Path, seed: int = 0, std: float = 0.3, guidance: float = 3.0, **config):
    """Save a tiny random Janus model, its generation config and a word-level tokenizer to `folder`."""
    torch.manual_seed(seed)
    model = transformers.JanusForConditionalGeneration(janus_config(**config)).eval()
    sharpen_(model, std, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS, pad_token_id=PAD, eos_token_id=EOS, guidance_scale=guidance,
        generation_kwargs={"boi_token_id": BOI})
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model
