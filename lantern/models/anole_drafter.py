"""LANTERN's Anole drafter (`anole_drafter`): an EAGLE-1 head over a Chameleon target, in LANTERN's own format.

A folder with `config.json` (a one-layer Chameleon config; `bias` of fc) and `pytorch_model.bin` or
`model.safetensors` with `embed_tokens.weight` (its own 65536-row BPE embeddings), `fc` (fc([embed(x_{t+1}); f_t]))
and `layers.0.*`, one Chameleon decoder layer as transformers names it (per-head q/k LayerNorms and the layer-0
input norm included). The output (no final norm) is read out by the target's head, as LANTERN reads it.

Its cache holds the prompt's pairs too, fed as LANTERN feeds them (docs/model-families.md): drafter tokens are image
codes 0..V-1, or V + a vocabulary id for the prompt's tokens (`prefix_tokens`). Both CFG rows sit at the positions
the core gives them: LANTERN's unconditional row runs P - 2 positions behind, a shift RoPE does not see across the
slots the row attends.
"""
from __future__ import annotations

from pathlib import Path
import torch
from safetensors.torch import load_file
from torch import nn

from lantern.models.kv_cache import StaticKVCache
from lantern.models.checkpoint import check_drafter_folder, load_tensors_file
from lantern.models.chameleon import ChameleonTarget
from lantern.models.language_model import attention
from lantern.models.gpt import attention_bias

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class AnoleDrafter(nn.Module):
    family = "chameleon"  # the targets it drafts for
    reads_prefix = True  # its cache holds the prompt's pairs (lantern.models.drafter.prefix_pairs)

    def __init__(self, layer_config, vocab: int, bias: bool = True):
        super().__init__()
        from transformers.models.chameleon.modeling_chameleon import ChameleonDecoderLayer  # the families extra
        dim = layer_config.hidden_size
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(2 * dim, dim, bias=bias)
        self.layers = nn.ModuleList([ChameleonDecoderLayer(layer_config, 0)])

    def prefix_tokens(self, target: ChameleonTarget, rows: torch.Tensor) -> torch.Tensor:
        """Prompt rows (B, P) -> the drafter tokens paired with f_0 .. f_{P-2}: each row's next prompt token."""
        return rows[:, 1:] + target.config.vocab_size

    def forward(self, target: ChameleonTarget, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, cache: StaticKVCache, slots: torch.Tensor) -> torch.Tensor:
        """Image codes, positions, slots (B, T); features (B, T, D); mask (B, T, s) over the drafter's cache.
        Returns predicted features (B, T, D), read out by `target.head`."""
        x = self.fc(torch.cat([self.embed_tokens(vocabulary_ids(target, tokens)).to(self.fc.weight.dtype),
                               features.to(self.fc.weight.dtype)], dim=-1))
        cos, sin = target.rope_at(positions, x.dtype)
        layer = self.layers[0]
        h = x + attention(layer.self_attn, layer.input_layernorm(x), cos, sin, attention_bias(mask, x.dtype), cache,
                          0, cache.flat(slots), mask.shape[-1], target.config)
        return h + layer.mlp(layer.post_attention_layernorm(h))


def vocabulary_ids(target: ChameleonTarget, tokens: torch.Tensor) -> torch.Tensor:
    """Drafter tokens (B, T) -> vocabulary ids: an image code c < V is its BPE token, V + i is the vocabulary's i."""
    v = target.config.vocab_size
    return torch.where(tokens < v, target.bpe_of_code[tokens.clamp(max=v - 1)], tokens - v)


def check_anole_drafter(folder: Path, tcfg) -> tuple[dict, Path]:
    """LANTERN's Anole drafter folder checked against a target's ChameleonConfig `tcfg`, before any weights are read:
    (its config, its weights file); ValueError naming what differs."""
    where = folder / "config.json"
    if not where.is_file():
        raise ValueError(f"drafter {folder}: expected LANTERN's Anole drafter folder (config.json + "
                         f"{' or '.join(WEIGHT_FILES)})")
    expect = {"model_type": "chameleon", "num_hidden_layers": 1, "hidden_size": tcfg.hidden_size,
              "num_attention_heads": tcfg.num_attention_heads, "vocab_size": tcfg.vocab_size}
    conf, weights = check_drafter_folder(folder, WEIGHT_FILES, expect, tcfg.num_key_value_heads)
    if conf.get("swin_norm") or conf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"drafter {where}: swin_norm / hidden_act {conf.get('hidden_act')!r}: lantern loads "
                         f"LANTERN's Anole drafters (standard layer order, silu)")
    return conf, weights


def read_anole_drafter(folder: Path, target_model) -> AnoleDrafter:
    """LANTERN's Anole drafter folder -> an AnoleDrafter for `target_model` (a ChameleonForConditionalGeneration)."""
    from transformers import ChameleonConfig  # the families extra
    tcfg = target_model.config
    conf, weights = check_anole_drafter(folder, tcfg)
    layer_config = ChameleonConfig(
        hidden_size=tcfg.hidden_size, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads, num_hidden_layers=1, vocab_size=tcfg.vocab_size,
        intermediate_size=int(conf.get("intermediate_size", tcfg.intermediate_size)),
        rms_norm_eps=float(conf.get("rms_norm_eps", tcfg.rms_norm_eps)),
        attention_bias=bool(conf.get("attention_bias", False)), mlp_bias=bool(conf.get("mlp_bias", False)))
    drafter = AnoleDrafter(layer_config, tcfg.vocab_size, bias=bool(conf.get("bias", True)))
    state = read_state(weights)
    missing = sorted(set(drafter.state_dict()) - set(state))
    extra = sorted(set(state) - set(drafter.state_dict()))
    if missing or extra:
        raise ValueError(f"drafter weights {weights}: " + "; ".join(
            part for part in (f"missing {', '.join(missing[:4])}" if missing else "",
                              f"unexpected {', '.join(extra[:4])}" if extra else "") if part))
    shapes = [k for k, v in drafter.state_dict().items() if tuple(state[k].shape) != tuple(v.shape)]
    if shapes:
        raise ValueError(f"drafter weights {weights}: {shapes[0]} has shape {tuple(state[shapes[0]].shape)}, the "
                         f"target needs {tuple(drafter.state_dict()[shapes[0]].shape)}")
    drafter.load_state_dict({k: v.float() for k, v in state.items()})
    return drafter.eval().requires_grad_(False)


def read_state(path: Path) -> dict:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    state = load_tensors_file(path, "drafter weights")
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds no state dict")
    return state

