"""Tiny stand-ins for the files docs/models.md asks a user for, under the page's own names: LlamaGen's t2i GPT
(256 image tokens, 120 caption tokens) and VQ-16 checkpoints as LlamaGen's training writes them, LANTERN's t2i
drafter folder and its `top_*_indices.npy` table, and a local T5 encoder folder (a 1-layer random T5 with a
word-level tokenizer). Random weights, all small: a test walks the page's commands over them.

    python tests/llamagen_files.py FOLDER      # writes them into FOLDER (to walk the page by hand)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from lantern.models.config import GPTConfig
from lantern.models.gpt import GPT
from lantern.models.rope import rope_table_2d
from lantern.models.vq import VQConfig, VQModel

VOCAB, CAPTION_DIM, HEADS = 64, 32, 4
WORDS = "a cat dog red blue sitting on the grass photo of an astronaut riding horse in forest with".split()
# a VQ-16 (four downsamplings) of 32 channels: 256 px -> 16 x 16 = 256 image tokens, LANTERN's t2i grid
VQ16_TINY = VQConfig(codebook_size=VOCAB, codebook_embed_dim=8, ch=32, ch_mult=(1, 1, 1, 1, 1), num_res_blocks=1,
                     z_channels=32, image_size=256)
GPT_TINY = GPTConfig(dim=64, n_layer=2, n_head=HEADS, vocab_size=VOCAB, block_size=256, multiple_of=192,
                     model_type="t2i", cls_token_num=120, caption_dim=CAPTION_DIM)


def write_t5_folder(folder: Path) -> Path:
    """A 1-layer T5 encoder of width CAPTION_DIM with random weights and a word-level tokenizer (tokenizer.json)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>").save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=len(vocab), d_model=CAPTION_DIM, d_kv=8, d_ff=64, num_layers=1,
                                num_heads=4)
    transformers.T5EncoderModel(cfg).eval().save_pretrained(folder)
    return folder


def write_gpt(path: Path, seed: int = 0) -> None:
    """As LlamaGen's train_t2i.py saves it: {"model" (with freqs_cis), "optimizer", "steps", "args"}."""
    torch.manual_seed(seed)
    gpt = GPT(GPT_TINY)
    with torch.no_grad():
        gpt.output.weight.mul_(20)  # peaked distributions, as a trained model's
    state = dict(gpt.state_dict(), freqs_cis=rope_table_2d(16, 16, 10000, 120))
    torch.save({"model": state, "optimizer": {}, "steps": 10,
                "args": argparse.Namespace(gpt_model="custom", image_size=256)}, path)


def write_vq(path: Path, seed: int = 1) -> None:
    """As LlamaGen's train_vq.py saves it, with the codebook_used training buffer."""
    torch.manual_seed(seed)
    state = VQModel(VQ16_TINY).state_dict()
    torch.save({"model": dict(state, **{"quantize.codebook_used": torch.zeros(65536)}), "optimizer": {},
                "discriminator": {}, "steps": 3, "args": argparse.Namespace(vq_model="VQ-16")}, path)


def write_npy_table(path: Path, seed: int = 2) -> None:
    """LANTERN's (V, V-1) table of each code's other codes, nearest first (a random order here)."""
    g = np.random.default_rng(seed)
    rows = [np.array([c for c in g.permutation(VOCAB) if c != v]) for v in range(VOCAB)]
    np.save(path, np.stack(rows).astype(np.int64))


def write_page_files(folder: Path) -> dict[str, Path]:
    """Every file of docs/models.md's t2i walk-through, under the page's names, in `folder`."""
    from test_llamagen_import import write_lantern_drafter

    folder.mkdir(parents=True, exist_ok=True)
    files = {"gpt": folder / "t2i_XL_stage1_256.pt", "vq": folder / "vq_ds16_t2i.pt",
             "drafter": folder / "llamagen_drafter", "table": folder / "top_16383_indices.npy",
             "t5": folder / "flan-t5-xl"}
    write_gpt(files["gpt"])
    write_vq(files["vq"])
    write_lantern_drafter(files["drafter"], GPT_TINY.dim, HEADS, VOCAB, "t2i", seed=3)
    write_npy_table(files["table"])
    write_t5_folder(files["t5"])
    return files


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    for name, path in write_page_files(Path(sys.argv[1])).items():
        print(f"{name:<8} {path}")
