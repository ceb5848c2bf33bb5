"""LlamaGen's files as LlamaGen writes them: GPT and VQ checkpoints, their configs inferred from the weights'
shapes, and LANTERN's published drafters (EAGLE-style `config.json` + `pytorch_model.bin` / `model.safetensors`).

Every reader checks its file against what it must be and raises ValueError naming the file and what was
expected; nothing here writes (lantern.bundle.from_llamagen does).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from lantern.models.config import GPTConfig
from lantern.models.checkpoint import (LLAMAGEN_OBJECTS, WRAPPER_KEYS, check_drafter_folder, load_into,
                                      load_tensors_file, stripped, weights_only)
from lantern.models.drafter import Drafter, DrafterOptions
from lantern.models.gpt import GPT
from lantern.models.vq import VQConfig, VQModel

# LlamaGen's sizes (autoregressive/models/gpt.py): name -> (n_layer, n_head, dim)
LLAMAGEN_GPT_SIZES: dict[str, tuple[int, int, int]] = {
    "GPT-B": (12, 12, 768), "GPT-L": (24, 16, 1024), "GPT-XL": (36, 20, 1280), "GPT-XXL": (48, 24, 1536),
    "GPT-XXXL": (48, 40, 2560), "GPT-1B": (22, 32, 2048), "GPT-3B": (24, 32, 3200), "GPT-7B": (32, 32, 4096),
}
WEIGHT_SETS = ("model", "ema")  # which weights of a training checkpoint: the trained ones or their EMA
# LlamaGen's sampling defaults (sample_c2i.py / sample_t2i.py)
SAMPLING = {"c2i": {"cfg_scale": 4.0, "temperature": 1.0, "top_k": 2000, "top_p": 1.0},
            "t2i": {"cfg_scale": 7.5, "temperature": 1.0, "top_k": 1000, "top_p": 1.0}}


def read_llamagen_state(path: str | Path, weights: str = "model", what: str = "checkpoint") -> dict[str, torch.Tensor]:
    """A LlamaGen .pt/.pth (a dict with "model" / "ema" / "module" / "state_dict", or a bare state_dict, maybe
    with LlamaGen's saved `args`) or .safetensors -> its state_dict, prefixes left by DDP and torch.compile
    stripped. Large files are memory-mapped, not copied."""
    path = Path(path)
    if weights not in WEIGHT_SETS:
        raise ValueError(f"weights {weights!r}; allowed: {', '.join(WEIGHT_SETS)}")
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; give the checkpoint file (.pt, .pth or .safetensors)")
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
    if path.suffix == ".safetensors":
        try:
            return stripped(load_file(str(path)))
        except Exception as e:  # noqa: BLE001  a damaged file is bad input
            raise ValueError(f"{what} {path} is not a readable safetensors file: {e}") from None
    raw = load_tensors_file(path, what, allowed=LLAMAGEN_OBJECTS, mmap=True)
    if isinstance(raw, dict) and weights == "ema":
        if not isinstance(raw.get("ema"), dict):
            raise ValueError(f"{what} {path} has no 'ema' weights; its top-level keys are {sorted(raw)[:8]}")
        raw = raw["ema"]
    elif isinstance(raw, dict):
        for key in WRAPPER_KEYS:
            if isinstance(raw.get(key), dict):
                raw = raw[key]
                break
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise ValueError(f"{what} {path} holds no state_dict of tensors (looked under 'model', 'module', "
                         f"'state_dict', and at the top level)")
    return stripped(raw)


def _shape(state: dict, key: str, path: Path, what: str) -> tuple[int, ...]:
    if key not in state:
        raise ValueError(f"{what} {path} has no {key!r}: not a LlamaGen {what} (its first keys: "
                         f"{sorted(state)[:5]})")
    return tuple(state[key].shape)


def infer_gpt_config(state: dict, path: Path, block_size: int, preset: Optional[str] = None,
                     heads: Optional[int] = None) -> tuple[GPTConfig, str]:
    """The GPTConfig of a LlamaGen GPT state_dict: vocabulary, width, depth, condition from the shapes; the
    head count from the LlamaGen size they match (or `preset`), or `heads` for a model of no LlamaGen size.
    Returns (config, size name)."""
    what = "GPT checkpoint"
    vocab, dim = _shape(state, "tok_embeddings.weight", path, what)
    layers = {int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))}
    n_layer = len(layers)
    if heads is not None and preset is not None:
        raise ValueError("--heads is for a GPT of no LlamaGen size; --preset names a LlamaGen size: give one")
    if heads is not None:
        if heads < 1 or dim % heads:
            raise ValueError(f"--heads {heads} must divide the GPT's width {dim}")
        name = f"custom ({n_layer} layers x {dim}, {heads} heads)"
    elif preset is not None:
        if preset not in LLAMAGEN_GPT_SIZES:
            raise ValueError(f"unknown LlamaGen size {preset!r}; allowed: {', '.join(LLAMAGEN_GPT_SIZES)}")
        want = LLAMAGEN_GPT_SIZES[preset]
        if (want[0], want[2]) != (n_layer, dim):
            raise ValueError(f"GPT checkpoint {path} has {n_layer} layers of width {dim}; {preset} has {want[0]} "
                             f"of width {want[2]}")
        name = preset
    else:
        matches = [n for n, (lay, _, d) in LLAMAGEN_GPT_SIZES.items() if (lay, d) == (n_layer, dim)]
        if len(matches) != 1:
            sizes = ", ".join(f"{n} ({lay} x {d})" for n, (lay, _, d) in LLAMAGEN_GPT_SIZES.items())
            raise ValueError(f"GPT checkpoint {path} has {n_layer} layers of width {dim}, which matches no LlamaGen "
                             f"size ({sizes}); name its size with --preset, or give --heads for another size")
        name = matches[0]
    n_head = heads if heads is not None else LLAMAGEN_GPT_SIZES[name][1]
    hd = dim // n_head
    qkv_rows = _shape(state, "layers.0.attention.wqkv.weight", path, what)[0]
    kv = (qkv_rows // hd - n_head) // 2
    fields = dict(dim=dim, n_layer=n_layer, n_head=n_head, n_kv_head=None if kv == n_head else kv,
                  vocab_size=vocab, block_size=block_size)
    ffn = _shape(state, "layers.0.feed_forward.w1.weight", path, what)[0]
    if ffn != gpt_config(path, dim=dim, n_head=n_head).ffn_hidden and ffn >= int(2 * 4 * dim / 3):
        fields["multiple_of"] = ffn  # find_multiple(hidden, ffn) == ffn for any hidden <= ffn
    if "cls_embedding.embedding_table.weight" in state:
        rows = _shape(state, "cls_embedding.embedding_table.weight", path, what)[0]
        fields.update(model_type="c2i", num_classes=rows - 1, cls_token_num=1)  # LlamaGen adds a null-class row
    elif "cls_embedding.cap_proj.fc1.weight" in state:
        caption_dim = _shape(state, "cls_embedding.cap_proj.fc1.weight", path, what)[1]
        tokens = _shape(state, "cls_embedding.uncond_embedding", path, what)[0]
        fields.update(model_type="t2i", caption_dim=caption_dim, cls_token_num=tokens)
    else:
        raise ValueError(f"GPT checkpoint {path} has neither a class embedding (cls_embedding.embedding_table) nor a "
                         f"caption projection (cls_embedding.cap_proj): not a LlamaGen c2i or t2i GPT")
    return gpt_config(path, **fields), name


def gpt_config(path: Path, **fields) -> GPTConfig:
    """GPTConfig(**fields) read from the GPT checkpoint at `path`, or a ValueError naming the file and the tensor
    the refused size came from."""
    try:
        return GPTConfig(**fields)
    except ValueError as e:
        raise ValueError(f"GPT checkpoint {path}: {e} (its width {fields['dim']} is tok_embeddings.weight's second "
                         f"dimension, over {fields['n_head']} heads)") from None


def load_gpt(state: dict, cfg: GPTConfig, path: Path) -> GPT:
    model = GPT(cfg)
    load_into(model, weights_only(state)[0], f"GPT checkpoint {path}")
    return model.eval()


def infer_vq_config(state: dict, path: Path, image_size: int) -> VQConfig:
    """The VQConfig of a LlamaGen VQ state_dict (VQ-8, VQ-16 or any other depth) from its shapes."""
    what = "VQ checkpoint"
    V, d = _shape(state, "quantize.embedding.weight", path, what)
    ch = _shape(state, "encoder.conv_in.weight", path, what)[0]
    z = _shape(state, "encoder.conv_out.weight", path, what)[0]
    levels = sorted({int(m.group(1)) for k in state if (m := re.match(r"encoder\.conv_blocks\.(\d+)\.", k))})
    res = {int(m.group(1)) for k in state if (m := re.match(r"encoder\.conv_blocks\.0\.res\.(\d+)\.", k))}
    mult = [_shape(state, f"encoder.conv_blocks.{i}.res.{len(res) - 1}.conv2.weight", path, what)[0] // ch
            for i in levels]
    try:
        return VQConfig(codebook_size=V, codebook_embed_dim=d, ch=ch, ch_mult=tuple(mult), num_res_blocks=len(res),
                        z_channels=z, norm_groups=32, image_size=image_size)
    except ValueError as e:
        raise ValueError(f"VQ checkpoint {path}: {e}") from None


def load_vq(state: dict, cfg: VQConfig, path: Path) -> VQModel:
    model = VQModel(cfg)
    load_into(model, state, f"VQ checkpoint {path}")
    return model.eval()


# --- LANTERN's drafters ----------------------------------------------------------------------------------------
LANTERN_INPUT_TYPES = {"c2i": ("c2i", 576), "t2i": ("t2i", 256), "t2i2": ("t2i", 1024)}  # RoPE grid it was built for
LANTERN_WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")


def is_lantern_drafter(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_lantern_drafter(folder: Path, target_cfg: GPTConfig) -> Drafter:
    """LANTERN's published drafter folder -> a lantern Drafter with the same weights, checked against the
    target: width, heads, vocabulary, condition type and image grid; it records LANTERN's caption mask."""
    expect = {"hidden_size": target_cfg.dim, "vocab_size": target_cfg.vocab_size, "num_hidden_layers": 1,
              "num_attention_heads": target_cfg.n_head}
    conf, weights = check_drafter_folder(folder, LANTERN_WEIGHT_FILES, expect, target_cfg.kv_heads)
    where = folder / "config.json"
    if conf.get("hidden_act", "silu") != "silu" or conf.get("qkv_bias") or conf.get("rope_scaling"):
        raise ValueError(f"drafter {where}: hidden_act {conf.get('hidden_act')!r}, qkv_bias, rope_scaling: lantern "
                         f"loads LANTERN's LlamaGen drafters (silu, no qkv bias, no RoPE scaling)")
    kind = conf.get("input_type", "t2i")
    if kind not in LANTERN_INPUT_TYPES:
        raise ValueError(f"drafter {where}: input_type {kind!r}; allowed: {', '.join(LANTERN_INPUT_TYPES)}")
    model_type, block = LANTERN_INPUT_TYPES[kind]
    if (model_type, block) != (target_cfg.model_type, target_cfg.block_size):
        raise ValueError(f"drafter {where}: input_type {kind!r} is for {model_type} models of {block} image tokens; "
                         f"the target is {target_cfg.model_type} with {target_cfg.block_size} (a drafter for another "
                         f"target)")
    state = read_llamagen_state(weights, what="drafter weights")
    options = DrafterOptions(input_norm="layers.0.input_layernorm.weight" in state, own_embedding=True,
                             ffn_hidden=int(conf.get("intermediate_size", target_cfg.ffn_hidden)),
                             norm_eps=float(conf.get("rms_norm_eps", 1e-6)), reads_prefix=True,
                             caption_mask="lantern")  # fed as LANTERN feeds it (lantern.engine.caption_mask)
    drafter = Drafter(target_cfg, options)
    load_into(drafter, lantern_drafter_keys(state, bias=conf.get("bias", True), dim=target_cfg.dim),
              f"drafter weights {weights}")
    return drafter.eval()


def lantern_drafter_keys(state: dict, bias: bool, dim: int) -> dict[str, torch.Tensor]:
    """LANTERN's key layout (HF Llama names, q/k/v apart) -> lantern's (LlamaGen names, wqkv fused). Keys not in
    LANTERN's layout pass through under their own names, so the strict load names them."""
    s = dict(state)
    out = {}
    p = "layers.0.self_attn."
    if all(p + f"{n}_proj.weight" in s for n in "qkv"):
        out["layer.attention.wqkv.weight"] = torch.cat([s.pop(p + f"{n}_proj.weight") for n in "qkv"])
    renames = {p + "o_proj.weight": "layer.attention.wo.weight",
               "layers.0.mlp.gate_proj.weight": "layer.feed_forward.w1.weight",
               "layers.0.mlp.up_proj.weight": "layer.feed_forward.w3.weight",
               "layers.0.mlp.down_proj.weight": "layer.feed_forward.w2.weight",
               "layers.0.post_attention_layernorm.weight": "layer.ffn_norm.weight",
               "layers.0.input_layernorm.weight": "layer.attention_norm.weight",
               "embed_tokens.weight": "embed_tokens.weight", "fc.weight": "fc.weight", "fc.bias": "fc.bias"}
    for old, new in renames.items():
        if old in s:
            out[new] = s.pop(old)
    if not bias and "fc.bias" not in out:
        out["fc.bias"] = torch.zeros(dim)  # a bias-free fc is the same map with a zero bias
    out.update(s)
    return out
