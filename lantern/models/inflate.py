"""Function-preserving inflation: a trained small target and drafter computing exactly what they compute, at a
larger compute shape (LlamaGen's GPT-B or GPT-L), so benchmarks get real acceptance at real compute cost. The
construction (docs/algorithms.md, "Measuring at LlamaGen scale"): head_dim kept and every weight in the top-left
block of its inflated matrix, norms rescaled, appended blocks all zero, and padded codes' logits held far below
every real one by a constant residual dim. Greedy tokens equal the small model's; sampled tokens too wherever the
draw is over a top-k support (the random stream then sees the same support); otherwise equal in distribution.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from lantern.models.config import GPTConfig
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT, RMSNorm, TransformerBlock

# LlamaGen's compute shapes (dim, layers, vocabulary; FFN hidden from dim with multiple_of 256). The head count
# follows from the small model's head_dim, which inflation keeps.
INFLATE_SHAPES: dict[str, dict] = {
    "GPT-B": dict(dim=768, n_layer=12, vocab_size=16384, multiple_of=256),
    "GPT-L": dict(dim=1024, n_layer=24, vocab_size=16384, multiple_of=256),
}
CONSTANT = 1e-3  # c: the constant residual dim, c^2 far below the real dims' mean square
PAD_LOGIT = 1e4  # L: padded codes' logits sit near -L * rsqrt(mean square of the final residual)


def inflated_config(cfg: GPTConfig, dim: int, n_layer: int, vocab_size: int, multiple_of: int = 256) -> GPTConfig:
    """The inflated model's config, refusing shapes inflation cannot reach (named with what is allowed)."""
    if cfg.model_type != "c2i":
        raise ValueError(f"inflation supports c2i models (a class embedding carries the constant dim); this model "
                         f"is {cfg.model_type!r}")
    hd = cfg.head_dim
    if dim <= cfg.dim or dim % hd:
        raise ValueError(f"inflated dim {dim} must exceed {cfg.dim} and be a multiple of head_dim {hd}")
    rep = cfg.n_head // cfg.kv_heads  # query heads per kv head, kept so head h still reads kv head h // rep
    n_head = dim // hd
    if n_head % rep:
        raise ValueError(f"inflated heads {n_head} must be a multiple of {rep} query heads per kv head")
    if n_layer < cfg.n_layer:
        raise ValueError(f"inflated depth {n_layer} must be at least the model's {cfg.n_layer}")
    if vocab_size <= cfg.vocab_size:
        raise ValueError(f"inflated vocabulary {vocab_size} must exceed the model's {cfg.vocab_size}")
    big = dataclasses.replace(cfg, dim=dim, n_layer=n_layer, n_head=n_head,
                              n_kv_head=None if cfg.n_kv_head is None else n_head // rep,
                              vocab_size=vocab_size, multiple_of=multiple_of, ffn_dim_multiplier=None)
    if big.ffn_hidden < cfg.ffn_hidden:
        raise ValueError(f"inflated FFN hidden {big.ffn_hidden} is below the model's {cfg.ffn_hidden}")
    return big


def preset_config(cfg: GPTConfig, shape: str) -> GPTConfig:
    if shape not in INFLATE_SHAPES:
        raise ValueError(f"unknown inflation shape {shape!r}; choose one of {sorted(INFLATE_SHAPES)}")
    return inflated_config(cfg, **INFLATE_SHAPES[shape])


def _norm(dst: RMSNorm, src: RMSNorm, d0: int, d1: int) -> None:
    dst.weight.zero_()
    dst.weight[:d0] = src.weight * math.sqrt(d0 / d1)
    dst.eps = src.eps * d0 / d1


def _block(dst: TransformerBlock, src: TransformerBlock, small: GPTConfig, big: GPTConfig) -> None:
    d0, d1 = small.dim, big.dim
    kv0, kv1 = small.kv_heads * small.head_dim, big.kv_heads * big.head_dim
    w = src.attention.wqkv.weight  # (D0 + 2 kv0, D0): q rows, k rows, v rows
    qkv = dst.attention.wqkv.weight  # (D1 + 2 kv1, D1)
    qkv.zero_()
    qkv[:d0, :d0] = w[:d0]
    qkv[d1:d1 + kv0, :d0] = w[d0:d0 + kv0]
    qkv[d1 + kv1:d1 + kv1 + kv0, :d0] = w[d0 + kv0:]
    dst.attention.wo.weight.zero_()
    dst.attention.wo.weight[:d0, :d0] = src.attention.wo.weight
    f0 = small.ffn_hidden
    for name in ("w1", "w3"):
        getattr(dst.feed_forward, name).weight.zero_()
        getattr(dst.feed_forward, name).weight[:f0, :d0] = getattr(src.feed_forward, name).weight
    dst.feed_forward.w2.weight.zero_()
    dst.feed_forward.w2.weight[:d0, :f0] = src.feed_forward.w2.weight
    _norm(dst.attention_norm, src.attention_norm, d0, d1)
    _norm(dst.ffn_norm, src.ffn_norm, d0, d1)


def _blank(cls, cfg: GPTConfig):
    """An uninitialised float32 module on the CPU (every value is written by the caller; skips a random init
    of a hundred million weights)."""
    with torch.device("meta"):
        module = cls(cfg)
    return module.to_empty(device="cpu").float().eval()


@torch.no_grad()
def inflate_target(target: GPT, big: GPTConfig) -> GPT:
    """`target` at the config `big` (from `inflated_config`), in float32, computing the same logits over the
    real vocabulary."""
    small = target.config
    d0, d1, v0 = small.dim, big.dim, small.vocab_size
    out = _blank(GPT, big)
    out.rope.copy_(target.rope)  # the same head_dim, grid and prefix: the same table
    table = out.cls_embedding.embedding_table.weight
    table.zero_()
    table[:, :d0] = target.cls_embedding.embedding_table.weight
    table[:, d0] = CONSTANT
    emb = out.tok_embeddings.weight
    emb.zero_()
    emb[:v0, :d0] = target.tok_embeddings.weight
    emb[:, d0] = CONSTANT
    for i, layer in enumerate(out.layers):
        if i < small.n_layer:
            _block(layer, target.layers[i], small, big)
        else:  # a block that adds exactly zero to the residual stream
            for p in layer.parameters():
                p.zero_()
    _norm(out.norm, target.norm, d0, d1)
    out.norm.weight[d0] = 1.0  # the constant reaches the head
    head = out.output.weight
    head.zero_()
    head[:v0, :d0] = target.output.weight
    head[v0:, d0] = -PAD_LOGIT / CONSTANT
    return out


@torch.no_grad()
def inflate_drafter(drafter: Drafter, big: GPTConfig) -> Drafter:
    """The drafter for the inflated target: fc reads the real dims of the token embedding and of the target's
    features, and writes the constant dim through its bias, so the head's padded logits sit at -L."""
    small = drafter.config
    d0, d1 = small.dim, big.dim
    out = _blank(Drafter, big)
    w, b = drafter.fc.weight, drafter.fc.bias  # (D0, 2 D0): [embedding | features]
    out.fc.weight.zero_()
    out.fc.weight[:d0, :d0] = w[:, :d0]
    out.fc.weight[:d0, d1:d1 + d0] = w[:, d0:]
    out.fc.bias.zero_()
    out.fc.bias[:d0] = b
    out.fc.bias[d0] = CONSTANT
    _block(out.layer, drafter.layer, small, big)
    return out


def inflate_proximity(proximity: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V0, K) neighbour table -> (V1, K): real codes keep their real neighbours; each padded code (never sampled
    or drafted) lists K distinct other padded codes, so every id indexes a row."""
    v0, k = proximity.shape
    padded = vocab_size - v0
    if k >= padded:
        raise ValueError(f"{k} neighbours need more than the {padded} padded codes of vocabulary {vocab_size}")
    i = torch.arange(padded)[:, None]
    rows = v0 + (i + torch.arange(1, k + 1)[None]) % padded  # (P, K), distinct, never the code itself
    return torch.cat([proximity, rows.to(proximity.dtype)])


@dataclasses.dataclass
class InflatedModels:
    shape: str
    target: GPT
    drafter: Drafter | None
    proximity: torch.Tensor | None
    real_vocab: int  # the codes the VQ decodes: the small model's vocabulary

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.target.parameters())


def inflate_models(target: GPT, drafter: Drafter | None, proximity: torch.Tensor | None,
                   shape: str | GPTConfig) -> InflatedModels:
    """Target, drafter and proximity table inflated to a named shape of INFLATE_SHAPES (or an inflated config)."""
    big = preset_config(target.config, shape) if isinstance(shape, str) else shape
    return InflatedModels(shape if isinstance(shape, str) else "custom", inflate_target(target, big),
                          inflate_drafter(drafter, big) if drafter is not None else None,
                          inflate_proximity(proximity, big.vocab_size) if proximity is not None else None,
                          target.config.vocab_size)
