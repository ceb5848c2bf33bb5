"""The model-family seam: what the decoding core and the backends need from a target, written down once.

A target is any `nn.Module` that satisfies `TargetModel` below. LlamaGen's GPT (lantern.models.gpt) does so
natively; other families (lantern.models.janus, lantern.models.chameleon) wrap the modules of a `transformers`
model loaded from a local folder, holding its weights by reference. docs/model-families.md describes the seam.

A folder's family is read from its config.json (`model_type`) before any weights are loaded: `inspect_folder`
refuses an architecture lantern does not run, or a config without an image vocabulary, with a ValueError that
names what is missing (exit code 2 on the command line).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from lantern.extras import require
from lantern.files.reading import UnreadableFile, read_json, read_json_object
from lantern.models.chameleon import ChameleonFamily, check_config
from lantern.models.folders import FolderInfo
from lantern.models.janus import JanusFamily
from lantern.models.kv_cache import StaticKVCache


@runtime_checkable
class TargetShape(Protocol):
    """The static facts of a target (its `config`) that runners, caches and the decoding core read."""

    family: str  # "llamagen", "janus", ...
    model_type: str  # a condition: "c2i" class ids (B,), "t2i" caption embeddings (B, P, C), "prompt" tokens (B, P)
    cls_token_num: int  # P, the prefix (condition) positions before the first image token
    block_size: int  # image tokens per image, raster order over a grid_size x grid_size grid
    grid_size: int  # Jacobi's spatial prior reads the token one grid row up
    vocab_size: int  # V, the image-token vocabulary: logits are (..., V), tokens are 0..V-1
    n_layer: int  # KV cache layers
    kv_heads: int
    head_dim: int
    dim: int  # width of the hidden states a drafter reads


@runtime_checkable
class TargetModel(Protocol):
    """What every backend step calls. Tokens are image-vocabulary indices 0..V-1 everywhere; a family whose
    image tokens live inside a larger vocabulary maps them in `embed_tokens` and restricts logits in `head`
    (so warping, acceptance and CFG never see a non-image token)."""

    config: TargetShape

    def embed_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """Condition rows -> prefix embeddings (B, P, D)."""

    def unconditional(self, cond: torch.Tensor) -> torch.Tensor:
        """The CFG counterpart of condition rows `cond`, one row each, of the same shape (LlamaGen: the null
        class or its learned null caption; Janus: the prompt with every token but BOS and BOI set to pad)."""

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image tokens (B, T) -> input embeddings (B, T, D)."""

    def forward_cached(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor) -> torch.Tensor:
        """h (B, T, D) at sequence `positions` (B, T), written into the preallocated `cache` at `slots` (B, T),
        attending by `mask` (B, T, s) bool over the cache's first s slots. Returns final-normed hidden (B, T, D)."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden (B, T, D) -> float32 logits over the image vocabulary (B, T, V)."""

    def placed(self, device: torch.device, dtype: torch.dtype) -> "TargetModel":
        """The target on `device` in `dtype`, frozen, for a runner; the caller's model is never changed (a copy
        where device or dtype differ; a family may return itself where they already match)."""

    # (optional) identity: str, what caches keyed by the model (acceptance records, calibrations) use instead of
    # hashing every weight: a family target's folder digest (`folder_identity`). Default: config and weights hashed.
    # (optional) prefix_visible(rows (B, P)) -> (B, P) bool: which prefix slots of each prompt row (conditional
    # and unconditional rows alike) a query may attend; the engine hides the others in every mask. Default: all.


def neutral_conditions(config: TargetShape, n: int, device=None) -> torch.Tensor:
    """n valid conditions that carry no request, by the kind of condition the target takes (`model_type`): class
    0 (c2i), an all-zero caption (t2i: LlamaGen's padding), a prompt of token 0 (prompt). What runners warm up and
    capture with, and what an engine's slots hold before their first request."""
    if config.model_type == "c2i":
        return torch.zeros(n, dtype=torch.long, device=device)
    if config.model_type == "prompt":
        return torch.zeros(n, config.cls_token_num, dtype=torch.long, device=device)
    return torch.zeros(n, config.cls_token_num, config.caption_dim, device=device)


# config.json model_type -> (family, the transformers class lantern loads)
FAMILIES = {"janus": ("janus", "JanusForConditionalGeneration"),
            "chameleon": ("chameleon", "ChameleonForConditionalGeneration")}


TRANSFORMERS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json", "generation_config.json", "tokenizer.json",
                      "tokenizer_config.json")


def is_family_folder(model) -> bool:
    """A transformers model folder, not a lantern bundle: its config.json names a `model_type`, or (a config.json
    missing, unreadable or without one) the folder holds files only transformers folders have. What is wrong
    with such a folder is left to the loader that reports it."""
    if not model or not Path(model).is_dir():
        return False
    root = Path(model)
    try:
        config = read_json(root / "config.json")
    except (FileNotFoundError, UnreadableFile):  # missing, a folder, unreadable, not UTF-8 or not JSON
        config = None
    if isinstance(config, dict) and "model_type" in config:
        return True
    return any((root / name).is_file() for name in TRANSFORMERS_FILES)


def inspect_folder(path: str | Path) -> FolderInfo:
    """Classify a model folder by its config.json, before loading anything; ValueError names what is wrong."""
    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{root}: config.json is missing (a model folder, a lantern bundle or a transformers "
                         f"model, is read from it)")
    cfg = read_json_object(cfg_path)
    if "target" in cfg and "vq" in cfg:
        return FolderInfo(root, "bundle", "LlamaGen GPT")
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{root}: model_type {model_type!r} (architectures {cfg.get('architectures')}) is not an "
                         f"image-token generator lantern runs; supported: a lantern bundle, "
                         + ", ".join(f"{t} ({arch})" for t, (_, arch) in FAMILIES.items()))
    family, arch = FAMILIES[model_type]
    if family == "janus":
        vocab = (cfg.get("vq_config") or {}).get("num_embeddings")
        tokens = (cfg.get("vision_config") or {}).get("num_image_tokens")
        if not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"{cfg_path} has no image vocabulary: vq_config.num_embeddings is missing (Janus "
                             f"generates VQ tokens from that codebook)")
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"{cfg_path} does not say how many tokens an image has: "
                             f"vision_config.num_image_tokens is missing")
        return FolderInfo(root, family, arch, vocab, tokens,
                           max_positions(cfg.get("text_config") or {}, cfg_path, "text_config."))
    if family == "chameleon":
        return FolderInfo(root, family, arch, *check_config(cfg, cfg_path), max_positions(cfg, cfg_path))
    raise AssertionError(f"family {family} has no config check")  # every FAMILIES entry has one above


def max_positions(cfg: dict, cfg_path: Path, prefix: str = "") -> int:
    """A language model config's max_position_embeddings (0 where it gives none); ValueError when it is not a
    positive integer."""
    value = cfg.get("max_position_embeddings", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{cfg_path}: {prefix}max_position_embeddings {value!r} is not a positive integer")
    return value


def require_transformers():
    """transformers, or a MissingExtra (a ValueError) naming the extra that installs it."""
    return require("transformers", "a model-family folder")


def check_family(path: str | Path, vq: str | None = None, need_vq: bool = False) -> FolderInfo:
    """Everything about a family folder that can be checked without loading weights; ValueError names what is wrong.
    vq: a VQGAN folder given by the user (Chameleon); need_vq: the VQ will be used (images decoded, or a proximity
    table built from its codebook)."""
    info = inspect_folder(path)
    if info.family == "bundle":
        raise ValueError(f"{info.path} is a lantern bundle, not a transformers model folder")
    require_transformers()
    if info.family == "chameleon":
        ChameleonFamily.check(info, vq, need_vq)
    elif vq is not None:
        raise ValueError(f"--vq is for Chameleon folders; a {info.family} folder decodes with its own VQ model")
    return info


def load_family(path: str | Path, vq: str | None = None, need_vq: bool = False):
    """A family folder's loaded model (lantern.models.janus.JanusFamily, lantern.models.chameleon.ChameleonFamily)."""
    info = check_family(path, vq, need_vq)
    return ChameleonFamily.load(info, vq, need_vq) if info.family == "chameleon" else JanusFamily.load(info)


