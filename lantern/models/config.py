"""Model configuration: one dataclass per model kind plus a presets dict (every default in one place)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


class ConfigFields:
    """A config dataclass as plain data: `to_dict`, and `from_dict`, which refuses unknown keys by name (a config
    for another model)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; allowed: {sorted(known)}")
        return cls(**d)


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass(frozen=True)
class GPTConfig(ConfigFields):
    """LlamaGen `ModelArgs`, minus the training-only dropout fields."""

    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: Optional[int] = None
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    num_classes: int = 1000
    caption_dim: int = 2048
    model_type: str = "c2i"  # "c2i" (class token prefix) or "t2i" (caption-embedding prefix)
    vocab_size: int = 16384
    cls_token_num: int = 1  # prefix length: 1 for c2i, 120 for LlamaGen t2i
    block_size: int = 256  # image tokens per image (a square grid)
    class_dropout_prob: float = 0.1  # > 0 adds the null-class row used by CFG

    def __post_init__(self):
        if self.model_type not in ("c2i", "t2i"):
            raise ValueError(f"model_type {self.model_type!r} is not one of 'c2i', 't2i'")
        if self.dim % self.n_head:
            raise ValueError(f"dim {self.dim} is not divisible by n_head {self.n_head}")
        if self.kv_heads <= 0 or self.n_head % self.kv_heads:
            raise ValueError(f"n_kv_head {self.n_kv_head} must divide n_head {self.n_head}")
        if self.grid_size ** 2 != self.block_size:
            raise ValueError(f"block_size {self.block_size} is not a square number of image tokens")
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of 4 for 2D RoPE")

    @property
    def family(self) -> str:
        return "llamagen"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def grid_size(self) -> int:
        return int(round(self.block_size ** 0.5))

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    @property
    def null_class(self) -> int:
        return self.num_classes

    @property
    def has_null_class(self) -> bool:
        return self.class_dropout_prob > 0

    @property
    def seq_len(self) -> int:
        """Prefix plus every image token: the positions that carry a RoPE row."""
        return self.cls_token_num + self.block_size


# LlamaGen's class-conditional sizes, plus small ones the tests and the embedded model use.
GPT_PRESETS: dict[str, dict] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-small": dict(n_layer=8, n_head=8, dim=384, vocab_size=1024, num_classes=10, multiple_of=64),
    # the embedded default: 16x16 tokens of 32x32 digit images (lantern/assets/default), grown from 6 layers
    "GPT-lantern-digits": dict(n_layer=12, n_head=8, dim=256, vocab_size=1024, num_classes=10, block_size=256,
                               multiple_of=64),
    "GPT-test": dict(n_layer=2, n_head=4, dim=64, vocab_size=64, num_classes=4, block_size=16, multiple_of=32),
}


def gpt_preset(name: str, **overrides) -> GPTConfig:
    if name not in GPT_PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(GPT_PRESETS)}")
    return GPTConfig(**{**GPT_PRESETS[name], **overrides})
