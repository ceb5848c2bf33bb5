"""The model-family seam: what the decoding core and the backends need from a target, written down once.

A target is any `nn.Module` that satisfies `TargetModel` below. LlamaGen's GPT (lantern.models.gpt) does so
natively; other families (lantern.models.janus, lantern.models.chameleon) wrap the modules of a `transformers` model loaded from a local
folder, holding its weights by reference. docs/model-families.md describes the seam and each family.

A folder's family is read from its config.json (`model_type`) before any weights are loaded: `inspect_folder`
refuses an architecture lantern does not run, or a config without an image vocabulary, with a ValueError that
names what is missing (exit code 2 on the command line).
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol, runtime_checkable

import torch

from lantern.files.reading import UnreadableFile, read_json, read_json_object
from lantern.models.kv_cache import StaticKVCache
from lantern.models.checkpoint import short_list


@runtime_checkable
class TargetShape(Protocol):
    """The static facts of a target (its `config`) that runners, caches and the decoding core read."""

    family: str  # "llamagen", "janus", ...
    model_type: str  # what a condition is: "c2i" class ids (B,), "t2i" caption embeddings (B, P, C), "prompt" token ids (B, P)
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


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers rotary embedding at (B, T) positions -> cos, sin (B, T, 1, hd) in `dtype`, computed in fp32
    as transformers does (inv_freq: its (hd/2,) frequencies; scaling: its attention_scaling)."""
    freqs = positions[..., None].float() * inv_freq  # (B, T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def unpadded_positions(positions: torch.Tensor, mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Each row's own positions (B, T): back by the prefix slots at or before the position that the row's mask
    (B, T, s) hides, so a row left-padded in its first `prefix_len` slots counts from its first real token, as the
    row without padding does."""
    prefix = torch.arange(prefix_len, device=positions.device)
    hidden = ~mask[..., :prefix_len] & (prefix <= positions[..., None])  # (B, T, P)
    return positions - hidden.sum(-1)


def left_padded(row: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    """A prompt's condition row (1, n) -> (1, length), `pad` before it; ValueError when it has more tokens."""
    n = row.shape[1]
    if n > length:
        raise ValueError(f"the prompt is {n} tokens with the model's own around it; allowed: at most {length}")
    return torch.cat([torch.full((1, length - n), pad, dtype=row.dtype), row], 1)


@dataclass(frozen=True)
class FolderInfo:
    """What a model folder is, read from its config.json alone."""

    path: Path
    family: str  # "bundle" (a lantern bundle) or a family name
    architecture: str
    image_vocab: int = 0
    image_tokens: int = 0


# config.json model_type -> (family, the transformers class lantern loads)
FAMILIES = {"janus": ("janus", "JanusForConditionalGeneration"),
            "chameleon": ("chameleon", "ChameleonForConditionalGeneration")}
EXTRA = "families"  # the pyproject extra that brings transformers


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
        return FolderInfo(root, family, arch, vocab, tokens)
    if family == "chameleon":
        from lantern.models.chameleon import check_config
        return FolderInfo(root, family, arch, *check_config(cfg, cfg_path))
    raise AssertionError(f"family {family} has no config check")  # every FAMILIES entry has one above


def require_transformers():
    """transformers, or a ValueError naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"model families need transformers: pip install 'lantern-decoding[{EXTRA}]'") from None
    return transformers


def check_family(path: str | Path, vq: str | None = None, need_vq: bool = False) -> FolderInfo:
    """Everything about a family folder that can be checked without loading weights; ValueError names what is wrong.
    vq: a VQGAN folder given by the user (Chameleon); need_vq: the VQ will be used (images decoded, or a proximity
    table built from its codebook)."""
    info = inspect_folder(path)
    if info.family == "bundle":
        raise ValueError(f"{info.path} is a lantern bundle, not a transformers model folder")
    require_transformers()
    if info.family == "chameleon":
        from lantern.models.chameleon import ChameleonFamily
        ChameleonFamily.check(info, vq, need_vq)
    elif vq is not None:
        raise ValueError(f"--vq is for Chameleon folders; a {info.family} folder decodes with its own VQ model")
    return info


def load_family(path: str | Path, vq: str | None = None, need_vq: bool = False):
    """A family folder's loaded model (lantern.models.janus.JanusFamily, lantern.models.chameleon.ChameleonFamily)."""
    info = check_family(path, vq, need_vq)
    if info.family == "chameleon":
        from lantern.models.chameleon import ChameleonFamily
        return ChameleonFamily.load(info, vq, need_vq)
    from lantern.models.janus import JanusFamily
    return JanusFamily.load(info)


# what transformers' from_pretrained reads from a folder, in its order of preference
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def read_config(config_class, root: Path):
    """config_class.from_pretrained(root), or a ValueError naming config.json and the field transformers refused
    (a field of the wrong type, an inconsistent sub-config)."""
    try:
        return config_class.from_pretrained(root)
    except Exception as e:  # noqa: BLE001  transformers validates fields with error types of its own
        raise ValueError(f"{root / 'config.json'} is not a usable {config_class.__name__}: {one_line(e)}") from None


def weights_files(root: Path) -> list[Path]:
    """The weights files from_pretrained will read in `root`, each one's header checked (a safetensors file that
    is empty, truncated or not safetensors); ValueError naming the folder or the file."""
    found = next((root / name for name in WEIGHTS_FILES if (root / name).is_file()), None)
    if found is None:
        raise ValueError(f"{root} has no weights: expected {' or '.join(WEIGHTS_FILES)}")
    files = [found]
    if found.name.endswith(".index.json"):
        shards = read_json_object(found).get("weight_map")
        if not isinstance(shards, dict) or not shards or not all(isinstance(v, str) for v in shards.values()):
            raise ValueError(f"{found}: weight_map is missing or is not a map of tensor names to file names")
        files = [root / name for name in sorted(set(shards.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{found} names weights files that are not in {root}: {short_list(absent)}")
    for f in files:
        if f.suffix == ".safetensors":
            check_safetensors(f)
    return files


def check_safetensors(path: Path) -> None:
    """ValueError naming `path` when its header cannot be read or does not cover the file exactly."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # noqa: BLE001  safetensors raises its own error type for every damaged header
        raise ValueError(f"weights file {path} ({path.stat().st_size} bytes) is not a readable safetensors file "
                         f"(empty, truncated or another format): {one_line(e)}") from None


@contextmanager
def transformers_held_back() -> Iterator[None]:
    """transformers' own report while lantern loads a folder held back: its table of the keys missing or of
    another shape ("newly initialized"), which load_pretrained's refusal replaces by naming the keys. Its loading
    bar stays (a large model loads for a while). Its verbosity is restored afterwards."""
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def load_pretrained(model_class, root: Path, config):
    """model_class.from_pretrained(root), frozen, refusing what transformers would load anyway: a weight or
    persistent buffer the files lack (it would be randomly initialised) or hold in another shape than the config
    gives (a changed hidden_size). ValueError names the folder, the files and the keys."""
    files = weights_files(root)
    names = ", ".join(f.name for f in files)
    try:
        with transformers_held_back():
            model, report = model_class.from_pretrained(root, config=config, output_loading_info=True,
                                                        ignore_mismatched_sizes=True)  # reported below, by name
    except Exception as e:  # noqa: BLE001  a file that passed the header check and still cannot be read
        reason = one_line(e)
        if "weights_only" in reason:  # torch's refusal of a pickle, with advice lantern does not pass on
            reason = "it holds Python objects besides tensors, which lantern does not load (a pickle can run code)"
        raise ValueError(f"{root}: weights {names} cannot be loaded: {reason}") from None
    missing = sorted(report["missing_keys"])
    shapes = sorted(f"{key}: file {tuple(got)} vs config {tuple(want)}" for key, got, want in report["mismatched_keys"])
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors missing {short_list(missing)}")
    if shapes:
        problems.append(f"{len(shapes)} tensors of another shape than config.json gives {short_list(shapes)}")
    if report["error_msgs"]:
        problems.append(f"load errors {short_list(report['error_msgs'])}")
    if problems:
        raise ValueError(f"{root}: weights {names} do not hold the model its config.json describes (part of it "
                         f"would run on random weights): " + "; ".join(problems))
    return model.eval().requires_grad_(False)


def load_tokenizer(root: Path):
    """The folder's tokenizer, or a ValueError naming the folder and what transformers could not read."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(root)
    except Exception as e:  # noqa: BLE001  a damaged tokenizer.json surfaces as several error types
        raise ValueError(f"{root}: the tokenizer cannot be loaded: {one_line(e)}") from None


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".ckpt")


def folder_identity(path: str | Path) -> str:
    """A model folder's identity without reading its weights: sha256 over its config files' contents and each
    weights file's name, size and modification time (rewriting a weights file changes it)."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.iterdir() if p.is_file()):
        if f.suffix == ".json":
            h.update(f"{f.name}|".encode() + f.read_bytes())
        elif f.suffix in WEIGHT_SUFFIXES:
            st = f.stat()
            h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()
