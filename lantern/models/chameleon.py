"""Chameleon-family targets (Anole, Chameleon; Lumina-mGPT shares the architecture but not the image stream, and is
refused: `check_not_lumina`): transformers' `ChameleonForConditionalGeneration` from a local folder, generating
images, with the prompt, CFG row and image tokens of Anole's own pipeline (docs/model-families.md).

lantern's tokens are the VQGAN codes 0..8191 (the BPE tokens `IMGIMG<code>Z`): `embed_tokens` maps a code to its BPE
id and `head` reads the image rows of `lm_head` only, in code order, so warping, CFG and acceptance never see a text
token. CFG's unconditional row `<s>, <racm3:break>` is left-padded with `<pad>`, hidden from every query
(`prefix_visible`), and `forward_cached` reads each row's position shift from the mask itself (`row_positions`), so
the core passes the same positions to both rows and needs no per-row state.

`ChameleonTarget` runs the language model's layers, q/k LayerNorms included, in the standard or the Swin-norm order
over lantern's static KV cache (lantern.models.language_model). Pixels come from the model's taming VQGAN
(lantern.models.vqgan), which transformers does not carry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lantern.files.reading import read_json_object
from lantern.models.folders import FolderInfo, folder_identity, load_pretrained, load_tokenizer, read_config
from lantern.models.language_model import STATIC_ROPE, LanguageModelTarget, PromptShape
from lantern.models.padding import left_padded, unpadded_positions
from lantern.models.prompt_text import check_prompt
from lantern.models.proximity import DEFAULT_K, build_proximity_table, index_dtype, read_npy_table
from lantern.models.vqgan import check_vqgan_folder, load_vqgan, vq_files

SPECIAL = {"bos": "<s>", "pad": "<pad>", "eot": "<reserved08706>", "boi": "<racm3:break>"}  # names in the vocabulary


def image_vocabulary(vocab_map: dict) -> torch.Tensor:
    """The vocabulary map's image tokens -> (V,) BPE id of each code 0..V-1; ValueError when the map has none or its
    codes are not exactly 0..V-1. Names `IMGIMG<letters>Z`, letters A..J for the digits of the code."""
    digits = {chr(ord("A") + i): str(i) for i in range(10)}
    codes = {}
    for name, bpe in vocab_map.items():
        if name.startswith("IMGIMG") and name.endswith("Z"):
            text = "".join(digits.get(c, "?") for c in name[len("IMGIMG"):-1])
            if text.isdigit():
                codes[int(text)] = bpe
    if not codes:
        raise ValueError("vocabulary_map has no image tokens (names IMGIMG<code>Z)")
    if sorted(codes) != list(range(len(codes))):
        raise ValueError(f"vocabulary_map's {len(codes)} image tokens do not name the codes 0..{len(codes) - 1}")
    return torch.tensor([codes[c] for c in range(len(codes))], dtype=torch.long)


class ChameleonTarget(LanguageModelTarget):
    qk_norm = True

    def __init__(self, hf_model, shape: PromptShape, bpe_of_code: torch.Tensor, bos: int, boi: int, pad: int):
        super().__init__(hf_model.model, shape, bos, boi, pad)
        self.swin_norm = bool(hf_model.config.swin_norm)
        self.register_buffer("bpe_of_code", bpe_of_code.clone(), persistent=False)  # (V,) code -> BPE id
        # the head's image rows in code order (V of the 65536 rows): the one copy the target makes
        self.register_buffer("image_head", hf_model.lm_head.weight.detach()[bpe_of_code].clone(), persistent=False)

    def unconditional(self, cond: torch.Tensor) -> torch.Tensor:
        """`<pad> ... <pad>, <s>, <racm3:break>` for each row (Anole's unconditional prompt, left-padded)."""
        rows = torch.full_like(cond, self.pad)
        rows[:, -2], rows[:, -1] = self.bos, self.boi
        return rows

    def prefix_visible(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, P) prompt rows -> (B, P) bool: the slots a query may attend (every slot but padding)."""
        return rows != self.pad

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embeddings(self.bpe_of_code[tokens])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.image_head).float()

    def row_positions(self, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each row's own positions: back by the prefix slots its mask hides (the unconditional row's left padding,
        a padded prompt's), so its `<s>` is at 0 as in Anole's pipeline."""
        return unpadded_positions(positions, mask, self.config.cls_token_num)


def chameleon_target(model, prompt_len: int, bpe_of_code: torch.Tensor, ids: dict) -> ChameleonTarget:
    """A ChameleonTarget over a ChameleonForConditionalGeneration for prompts of `prompt_len` tokens."""
    cfg = model.config
    grid = image_grid(cfg.vq_config)
    heads = cfg.num_attention_heads
    shape = PromptShape(family="chameleon", cls_token_num=prompt_len, block_size=grid * grid, grid_size=grid,
                        vocab_size=len(bpe_of_code), n_layer=cfg.num_hidden_layers, n_head=heads,
                        kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // heads, dim=cfg.hidden_size)
    return ChameleonTarget(model, shape, bpe_of_code, ids["bos"], ids["boi"], ids["pad"])


def image_grid(vq_config) -> int:
    """Tokens per image side: the VQGAN's resolution over its downsampling (2 per level after the first)."""
    get = vq_config.get if isinstance(vq_config, dict) else lambda k, d=None: getattr(vq_config, k, d)
    return get("resolution") // 2 ** (len(get("channel_multiplier")) - 1)


def read_lantern_table(path: str | Path, bpe_of_code: torch.Tensor, k: int) -> torch.Tensor:
    """LANTERN's Anole proximity table (`top_8191_indices.npy`) -> (V, k) neighbour codes in code order.

    LANTERN's Anole code reads the table by image-token slot, the BPE id less the first image token's id (its
    `image_token_offset`, 4 in Anole's vocabulary): row `bpe - offset` lists neighbours as slots, `slot + offset`
    being their BPE tokens. Here a code c reads row bpe_of_code[c] - offset and each neighbour slot becomes the code
    whose BPE token it names, so relaxed acceptance over codes sees the neighbourhoods LANTERN's acceptance sees.
    ValueError (naming the file) for a table that is not (V, K) integers in [0, V), or a vocabulary whose image
    tokens are not one contiguous block of ids (no slot order to read)."""
    v = len(bpe_of_code)
    offset = int(bpe_of_code.min())
    if int(bpe_of_code.max()) - offset != v - 1:
        raise ValueError(f"proximity table {path}: the vocabulary's {v} image tokens are not contiguous ids "
                         f"({offset}..{int(bpe_of_code.max())}), so a table indexed by image-token slot cannot be "
                         f"read")
    table = read_npy_table(path, v, k).long()  # (V, k) slots, checked in [0, V)
    slot_of_code = bpe_of_code - offset
    code_of_slot = torch.empty_like(slot_of_code)
    code_of_slot[slot_of_code] = torch.arange(v)
    return code_of_slot[table[slot_of_code]].to(index_dtype(v)).contiguous()


LUMINA_ARCHITECTURE = "ChameleonXLLMXForConditionalGeneration"  # what Lumina-mGPT's save_pretrained writes
LUMINA_KEYS = ("z_loss_weight", "mask_image_logits")  # fields only Lumina-mGPT's config classes carry


def check_not_lumina(cfg: dict, cfg_path: Path) -> None:
    """ValueError for a Lumina-mGPT config.json (its architecture or its config class's own fields): its image stream
    is not Anole's, so Anole's prompt and token layout would generate the wrong sequence."""
    marks = [f"architectures {LUMINA_ARCHITECTURE}"] if LUMINA_ARCHITECTURE in (cfg.get("architectures") or []) else []
    marks += [key for key in LUMINA_KEYS if key in cfg]
    if marks:
        raise ValueError(f"{cfg_path} is a Lumina-mGPT model ({', '.join(marks)}): lantern runs Anole's image layout, "
                         f"and Lumina-mGPT generates its own (its chat template, <racm3:break> and two resolution "
                         f"tokens, a new-line token after every row of codes, CFG against the sequence from "
                         f"<racm3:break> on), which lantern does not run yet")


def check_config(cfg: dict, cfg_path: Path) -> tuple[int, int]:
    """A chameleon config.json -> (image vocabulary, image tokens); ValueError naming what is missing (or that it is
    a Lumina-mGPT model, whose layout lantern does not run)."""
    check_not_lumina(cfg, cfg_path)
    vocab_map = cfg.get("vocabulary_map")
    if not isinstance(vocab_map, dict):
        raise ValueError(f"{cfg_path} has no image vocabulary: vocabulary_map is missing (Chameleon finds its "
                         f"image tokens, IMGIMG<code>Z, there)")
    try:
        codes = len(image_vocabulary(vocab_map))
    except ValueError as e:
        raise ValueError(f"{cfg_path} has no usable image vocabulary: {e}") from None
    missing = [name for name in SPECIAL.values() if name not in vocab_map]
    if missing:
        raise ValueError(f"{cfg_path}: vocabulary_map lacks {', '.join(missing)} (Anole's image prompt and its CFG "
                         f"prompt are built from them)")
    vq = cfg.get("vq_config") or {}
    if not isinstance(vq.get("resolution"), int) or not isinstance(vq.get("channel_multiplier"), list):
        raise ValueError(f"{cfg_path} does not say how many tokens an image has: vq_config.resolution and "
                         f"vq_config.channel_multiplier are missing")
    grid = image_grid(vq)
    return codes, grid * grid


def find_vq(root: Path, given: Optional[str]) -> Optional[Path]:
    """The VQGAN folder: `given` (--vq), else the first of <model>/tokenizer, <model>, <model>/../tokenizer that
    holds vqgan.yaml and vqgan.ckpt (Chameleon's and Anole's layout); None if there is none."""
    if given is not None:
        return Path(given)
    for folder in (root / "tokenizer", root, root.parent / "tokenizer"):
        if all(p.is_file() for p in vq_files(folder)):
            return folder
    return None


@dataclass
class ChameleonFamily:
    """A Chameleon / Anole folder, loaded: the transformers model, its tokenizer, token ids and VQGAN folder."""

    path: Path
    model: nn.Module  # ChameleonForConditionalGeneration
    tokenizer: object
    ids: dict  # bos, pad, eot, boi
    bpe_of_code: torch.Tensor
    vq_path: Optional[Path]
    default_sampling: dict
    relaxation_defaults: dict = field(default_factory=dict)
    _targets: dict = field(default_factory=dict)
    _vq: Optional[nn.Module] = None

    family = "chameleon"

    @classmethod
    def check(cls, info: FolderInfo, vq: Optional[str] = None, need_vq: bool = False) -> Optional[Path]:
        """Everything but the weights: tokenizer, RoPE, and (where the VQ is needed) the VQGAN's files and shape.
        Returns the VQGAN folder (None if there is none and it is not needed)."""
        root = info.path
        if not any((root / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"{root} has no tokenizer (tokenizer.json): a prompt cannot be turned into tokens")
        cfg = read_json_object(root / "config.json")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in STATIC_ROPE:
            raise ValueError(f"{root}: rope type {rope_type!r} changes with the sequence length; supported: "
                             f"{', '.join(STATIC_ROPE)}")
        folder = find_vq(root, vq)
        if folder is None:
            if need_vq:
                raise ValueError(f"{root}: no VQGAN found (vqgan.yaml and vqgan.ckpt in {root}/tokenizer, {root} or "
                                 f"{root.parent}/tokenizer): give --vq FOLDER, or --no-images for tokens only (and "
                                 f"for a relaxed method --proximity: its table comes from the VQGAN's codebook "
                                 f"otherwise)")
            return None
        check_vqgan_folder(folder, info.image_vocab, image_grid(cfg["vq_config"]))
        return folder

    @classmethod
    def load(cls, info: FolderInfo, vq: Optional[str] = None, need_vq: bool = False) -> "ChameleonFamily":
        from transformers import ChameleonConfig, ChameleonForConditionalGeneration  # the families extra
        vq_path = cls.check(info, vq, need_vq)
        vq_model = load_vqgan(vq_path) if need_vq and vq_path is not None else None  # refused before any work
        root = info.path
        config = read_config(ChameleonConfig, root)
        vocab_map = config.vocabulary_map
        ids = {key: vocab_map[name] for key, name in SPECIAL.items()}
        model = load_pretrained(ChameleonForConditionalGeneration, root, config)
        tokenizer = load_tokenizer(root)
        sampling = {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 2000, "top_p": 1.0}  # Anole in LANTERN's paper
        return cls(root, model, tokenizer, ids, image_vocabulary(vocab_map), vq_path, default_sampling=sampling,
                   _vq=vq_model)

    @property
    def image_vocab(self) -> int:
        return len(self.bpe_of_code)

    @property
    def grid_size(self) -> int:
        return image_grid(self.model.config.vq_config)

    @property
    def image_tokens(self) -> int:
        return self.grid_size ** 2

    @property
    def image_size(self) -> int:
        """Pixels per side of a decoded image (the VQGAN's upsampling of the token grid)."""
        return self.grid_size * self.vq.scale

    def prompt_rows(self, prompt: str, length: Optional[int] = None) -> torch.Tensor:
        """A prompt's condition row (1, P): `<s>`, the prompt's tokens, end of turn, begin image (Anole's layout);
        with `length`, left-padded with `<pad>` to (1, length), which the target hides (ValueError if longer, or if
        the prompt is not text: lantern.models.prompt_text)."""
        text = list(self.tokenizer(check_prompt(prompt), add_special_tokens=False)["input_ids"])
        row = torch.tensor([[self.ids["bos"], *text, self.ids["eot"], self.ids["boi"]]], dtype=torch.long)
        return row if length is None else left_padded(row, length, self.ids["pad"])

    def target(self, prompt_len: int, padded: bool = False) -> ChameleonTarget:
        """The target for prompts of `prompt_len` tokens (one static prefix length), built once per length. It
        hides `<pad>` slots whatever `padded` says (its unconditional row is left-padded), so left-padded prompt
        rows (`prompt_rows(prompt, length)`) run on it as they are."""
        if prompt_len not in self._targets:
            target = chameleon_target(self.model, prompt_len, self.bpe_of_code, self.ids)
            target.identity = folder_identity(self.path)  # the caches of --method auto are keyed by the folder
            self._targets[prompt_len] = target
        return self._targets[prompt_len]

    @property
    def vq(self) -> nn.Module:
        """The model's VQGAN decoder (lantern.models.vqgan), loaded on first use."""
        if self.vq_path is None:
            raise ValueError(f"{self.path}: no VQGAN (give --vq FOLDER)")
        if self._vq is None:
            self._vq = load_vqgan(self.vq_path)
        return self._vq

    def decode_images(self, tokens: torch.Tensor) -> np.ndarray:
        """(B, block) image codes -> uint8 images (B, H, W, 3) through the model's VQGAN."""
        return self.vq.decode(tokens)

    def proximity_table(self) -> torch.Tensor:
        """LANTERN's latent proximity table of the VQGAN codebook (V, k) in code order, for relaxed acceptance."""
        return build_proximity_table(self.vq.quantize.embedding.weight.detach(), DEFAULT_K)

    def describe(self) -> dict:
        cfg = self.model.config
        return {"path": str(self.path), "family": self.family, "architecture": "ChameleonForConditionalGeneration",
                "language_model": f"{cfg.num_hidden_layers} layers x hidden {cfg.hidden_size} x "
                                  f"{cfg.num_attention_heads} heads ({cfg.num_key_value_heads} kv)",
                "image_vocab": self.image_vocab, "image_tokens": self.image_tokens,
                "grid": f"{self.grid_size}x{self.grid_size}", "default_sampling": self.default_sampling,
                "vq": str(self.vq_path) if self.vq_path else "none found (tokens only; give --vq FOLDER)"}
