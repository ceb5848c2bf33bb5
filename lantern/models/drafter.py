"""EAGLE-1 style drafter: fc([emb(x_{t+1}); f_t]) -> one LlamaGen decoder layer -> predicted f_{t+1}.

The drafter owns `fc` and `layer`; the RoPE table, final head and null condition are the target's (frozen),
passed in at call time. The token embedding is the target's too, unless the drafter was trained with its own
(`DrafterOptions.own_embedding`, as LANTERN's published drafters are: `embed_tokens`).
Position convention: the pair (f_t, x_{t+1}) sits at x_{t+1}'s sequence position, and its output is the
drafter's guess of f_{t+1}, whose logits predict x_{t+2}. (LANTERN's drafters put the same pair at position
one lower in a RoPE table with one prefix row fewer: the same rotation.)
Where the drafter's cache starts: lantern's drafters at the first image token (the pair (f_{P-1}, x_P)); a drafter
that `reads_prefix` also holds the condition prefix's pairs (f_i, its `prefix_tokens`) for i < P-1, fed once at
prefill (LANTERN's t2i drafters: token 0, as LANTERN pads their input ids with zeros over the caption and masks
nothing; LANTERN's Anole drafter, lantern.models.anole_drafter: the next prompt token).
Which caption mask the target's features at padded caption slots were computed with (lantern.engine.caption_mask):
`caption_mask`, recorded in the options; a drafter whose options record none expects LANTERN's if it reads the
prefix (only LANTERN's drafters do) and LlamaGen's otherwise (lantern's own, which never read a padded slot).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lantern.models.config import ConfigFields, GPTConfig
from lantern.models.kv_cache import StaticKVCache
from lantern.models.gpt import GPT, FeedForward, RMSNorm, TransformerBlock, attention_bias

# the conventions of the features a drafter reads at padded caption slots (lantern.engine.caption_mask)
CAPTION_MASKS = ("llamagen", "lantern")


def check_caption_mask(name: str) -> str:
    if name not in CAPTION_MASKS:
        raise ValueError(f"caption mask {name!r}; allowed: {', '.join(CAPTION_MASKS)}")
    return name


@dataclass(frozen=True)
class DrafterOptions(ConfigFields):
    """How a drafter's layer departs from the target's blocks (defaults: lantern's own drafters)."""

    input_norm: bool = True  # False: no RMSNorm before attention (EAGLE's first layer, LANTERN's drafters)
    own_embedding: bool = False  # True: the drafter's own `embed_tokens` (V, D) embeds x_{t+1}
    ffn_hidden: Optional[int] = None  # SwiGLU width (None: the target's)
    norm_eps: Optional[float] = None  # RMSNorm epsilon (None: the target's)
    reads_prefix: bool = False  # True: its cache holds the prefix pairs (f_i, token 0), i < P-1 (LANTERN's)
    # the caption mask its t2i features at padded slots were computed with (CAPTION_MASKS above);
    # None: "lantern" if it reads the prefix, else "llamagen" (what bundles written before this field hold)
    caption_mask: Optional[str] = None

    def __post_init__(self):
        if self.caption_mask is not None:
            check_caption_mask(self.caption_mask)


class Drafter(nn.Module):
    def __init__(self, cfg: GPTConfig, options: Optional[DrafterOptions] = None):
        super().__init__()
        self.config = cfg
        self.options = options = options or DrafterOptions()
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=True)
        self.layer = TransformerBlock(cfg, layer_id=0)
        eps = cfg.norm_eps if options.norm_eps is None else options.norm_eps
        self.layer.attention_norm = RMSNorm(cfg.dim, eps) if options.input_norm else nn.Identity()
        self.layer.ffn_norm = RMSNorm(cfg.dim, eps)
        if options.ffn_hidden is not None:
            self.layer.feed_forward = FeedForward(cfg, options.ffn_hidden)
        if options.own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)

    @property
    def reads_prefix(self) -> bool:
        """Whether its cache holds the condition prefix's pairs (lantern.models.drafter.prefix_pairs)."""
        return self.options.reads_prefix

    @property
    def caption_mask(self) -> str:
        """The caption mask (lantern.engine.caption_mask) its caption features are computed with."""
        return self.options.caption_mask or ("lantern" if self.options.reads_prefix else "llamagen")

    def prefix_tokens(self, target: GPT, rows: torch.Tensor) -> torch.Tensor:
        """Condition rows (B, P, C) -> the tokens paired with the prefix features f_0 .. f_{P-2}: token 0, as
        LANTERN zero-pads its t2i drafters' input ids over the caption."""
        return torch.zeros(rows.shape[0], target.config.cls_token_num - 1, dtype=torch.long, device=rows.device)

    def embed(self, target: GPT, tokens: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.options.own_embedding else target.tok_embeddings
        return table(tokens)

    def forward(self, target: GPT, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: Optional[torch.Tensor] = None, cache: Optional[StaticKVCache] = None,
                slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens, positions (B, T); features (B, T, D); mask (B, T, S) or None for causal over T.
        Returns predicted features (B, T, D), to be read out by `target.head`."""
        x = self.fc(torch.cat([self.embed(target, tokens).to(self.fc.weight.dtype),
                               features.to(self.fc.weight.dtype)], dim=-1))
        rope = target.rope_at(positions)
        flat = cache.flat(slots) if cache is not None else None
        m = attention_bias(mask, x.dtype) if mask is not None else None
        return self.layer(x, rope, m, cache, flat)


def prefix_pairs(drafter, target_config) -> int:
    """Pairs a drafter reads over the target's condition prefix at prefill: P - 1 if it `reads_prefix` (the prefix
    features f_0 .. f_{P-2}, each with the token after it), else 0 (its cache starts at the first image token)."""
    return target_config.cls_token_num - 1 if drafter is not None and drafter.reads_prefix else 0
