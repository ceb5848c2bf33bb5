"""Logits -> target distribution on the runner's device: classifier-free guidance, temperature, top-k, top-p.

Distributions are kept on their support: `Support(probs, ids)` holds the K most likely tokens in descending
order (K = top-k when it is on, else the whole vocabulary), with top-p's removed tokens at probability 0.
Everything the acceptance walk does happens on (..., K) instead of (..., V). Random draws (Gumbel-max) come
from a `Draws` source: the step engine's per-slot counter-based streams (lantern.engine.draws: dim 0 of every
draw is the image's slot, so an image's draws depend on its own seed only), or a seeded torch.Generator
(single-purpose instruments and tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Union

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """greedy=True takes the argmax (temperature etc. then still shape the distribution, not the choice)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    cfg_scale: float = 1.0  # 1 = no guidance, and no unconditional rows

    def __post_init__(self):
        for name in ("temperature", "top_p", "cfg_scale"):
            value = getattr(self, name)
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"{name} {value} must be a finite number")
        if not self.temperature > 0:
            raise ValueError(f"temperature {self.temperature} must be > 0 (use greedy for argmax)")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1]")
        if self.cfg_scale < 1:
            raise ValueError(f"cfg_scale {self.cfg_scale} must be >= 1 (1 turns guidance off)")

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale > 1.0

    @property
    def rows_per_image(self) -> int:
        return 2 if self.use_cfg else 1

    def support_size(self, vocab: int) -> int:
        """K: tokens a warped distribution can put mass on."""
        return self.top_k if 0 < self.top_k < vocab else vocab


class Support(NamedTuple):
    """A distribution on its K most likely tokens, in descending order of probability."""

    probs: torch.Tensor  # (..., K) float32, sums to 1
    ids: torch.Tensor  # (..., K) int64 token ids

    def prob_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """(...) or (..., C) token ids -> their probabilities, same shape (0 off the support)."""
        squeeze = tokens.dim() == self.ids.dim() - 1
        t = tokens[..., None] if squeeze else tokens
        if t.shape[-1] == 1:  # one token a row: compare along the support, O(K)
            out = torch.where(self.ids == t, self.probs, 0.0).sum(-1, keepdim=True)
        else:
            out = self.lookup().prob(t)
        return out[..., 0] if squeeze else out

    def lookup(self, vocab: int | None = None) -> "SupportLookup":
        """To find many tokens in the support: by token id sorted (O(log K) each), or given the vocabulary's size
        and a support at least half of it, through a per-code table (O(1) each)."""
        return SupportLookup(self, vocab)

    def dense(self, vocab: int) -> torch.Tensor:
        """(..., V) probabilities."""
        out = torch.zeros(*self.probs.shape[:-1], vocab, dtype=self.probs.dtype, device=self.probs.device)
        return out.scatter_(-1, self.ids, self.probs)

    def index(self, idx: torch.Tensor) -> "Support":
        """Gather along dim 1: (B, N, K) supports, idx (B, M) -> (B, M, K)."""
        k = self.probs.shape[-1]
        at = idx[..., None].expand(*idx.shape, k)
        return Support(self.probs.gather(1, at), self.ids.gather(1, at))


class SupportLookup:
    """Where tokens sit in a Support, one of three ways, chosen from its shape:
    - a narrow support (K <= NARROW): each token compared with the K ids, O(C * K) for C tokens, nothing built
      first (one reduction a compiled step fuses with its neighbours, instead of a sort and a search);
    - else by token id sorted once (..., K), then a binary search per token: O((K + C) log K) time and O(K + C)
      memory, never a (..., C, K) comparison;
    - else, given the vocabulary's size V <= DENSE_SHARE * K (a wide support), each code's index in the support
      (..., V) int32, written once, then one read per token: O(V + C) time, and no more memory than the sort."""

    NARROW = 32
    DENSE_SHARE = 2

    def __init__(self, support: Support, vocab: int | None = None):
        self.support = support
        ids = support.ids
        self.index_of = self.sorted_ids = self.order = None
        if ids.shape[-1] <= self.NARROW:
            return
        if vocab is not None and vocab <= self.DENSE_SHARE * ids.shape[-1]:
            index = torch.arange(ids.shape[-1], dtype=torch.int32, device=ids.device).expand(ids.shape)
            self.index_of = torch.full((*ids.shape[:-1], vocab), -1, dtype=torch.int32, device=ids.device)
            self.index_of.scatter_(-1, ids, index)  # -1: a code off the support
        else:
            self.sorted_ids, self.order = ids.sort(-1)

    @property
    def narrow(self) -> bool:
        return self.index_of is None and self.sorted_ids is None

    def _matches(self, tokens: torch.Tensor) -> torch.Tensor:
        """(..., C) token ids -> (..., C, K) bool: which support slot holds each (at most one: the ids are distinct)."""
        return self.support.ids[..., None, :] == tokens[..., None]

    def position(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., C) token ids -> (their index in the support (..., C), found (..., C) bool); index 0 where not
        found."""
        if self.narrow:
            match = self._matches(tokens)
            return match.int().argmax(-1), match.any(-1)
        if self.index_of is not None:
            at = self.index_of.gather(-1, tokens)
            found = at >= 0
            return at.clamp_min_(0).long(), found
        at = torch.searchsorted(self.sorted_ids, tokens.contiguous()).clamp(max=self.sorted_ids.shape[-1] - 1)
        found = self.sorted_ids.gather(-1, at) == tokens
        return torch.where(found, self.order.gather(-1, at), 0), found

    def prob(self, tokens: torch.Tensor) -> torch.Tensor:
        """(..., C) token ids -> their probabilities (0 off the support)."""
        if self.narrow:  # the one matching slot's probability, plus zeros: exact
            return torch.where(self._matches(tokens), self.support.probs[..., None, :], 0.0).sum(-1)
        at, found = self.position(tokens)
        return torch.where(found, self.support.probs.gather(-1, at), 0.0)


def per_image(value, like: torch.Tensor):
    """A number, or a (B,) tensor of one value per image, shaped to broadcast over `like` (B, ...)."""
    return value.view(-1, *([1] * (like.dim() - 1))) if isinstance(value, torch.Tensor) else value


def combine_cfg(logits: torch.Tensor, scale, use_cfg: bool) -> torch.Tensor:
    """logits (R, ..., V) with rows [cond; uncond] -> (R/2, ..., V): u + s * (c - u); scale a number or one per
    image (B,)."""
    if not use_cfg:
        return logits
    cond, uncond = logits.float().chunk(2, dim=0)
    return uncond + per_image(scale, cond) * (cond - uncond)


def warp(logits: torch.Tensor, cfg: SamplingConfig, broad: int = 0) -> Support:
    """(..., V) guided logits -> the distribution after temperature, top-k and top-p, on its support; with `broad`,
    after temperature alone, on its `broad` most likely tokens (what a fanned Jacobi window mixes in). The
    temperature may be one per image ((B,) tensor; logits (B, ..., V))."""
    t = cfg.temperature
    x = logits.float() if not isinstance(t, torch.Tensor) and t == 1.0 else logits.float() / per_image(t, logits)
    k = broad or cfg.support_size(x.shape[-1])
    top_p = 1.0 if broad else cfg.top_p
    if broad or k < x.shape[-1] or top_p < 1.0:
        vals, ids = torch.topk(x, k, dim=-1)  # sorted, descending
    else:
        vals, ids = x, torch.arange(x.shape[-1], device=x.device).expand(x.shape)
    probs = torch.softmax(vals, dim=-1)
    if top_p < 1.0:
        # drop a token once the mass before it already reaches top_p (the first token always stays)
        before = probs.cumsum(-1) - probs
        probs = torch.softmax(vals.masked_fill(before >= top_p, float("-inf")), dim=-1)
    return Support(probs, ids)


class GuidedLogits(NamedTuple):
    """A verify step's guided logits (B, N, V), warped only at the nodes the acceptance asks for (its parent
    nodes and each image's last accepted node): top-k over V is the costly part, and most nodes are leaves."""

    logits: torch.Tensor
    sampling: SamplingConfig

    def index(self, idx: torch.Tensor) -> Support:
        """idx (B, M) node ids -> their distributions (B, M, K), like Support.index."""
        v = self.logits.shape[-1]
        return warp(self.logits.gather(1, idx[..., None].expand(*idx.shape, v)), self.sampling)


def target_support(logits: torch.Tensor, cfg: SamplingConfig, broad: int = 0) -> Support:
    """(R*B, ..., V) step logits, rows [cond; uncond] -> per image (B, ..., K) (`broad`: as warp's)."""
    return warp(combine_cfg(logits, cfg.cfg_scale, cfg.use_cfg), cfg, broad)


class SlotStreams(Protocol):
    def uniform(self, shape) -> torch.Tensor:
        """Uniforms in (0, 1) of `shape`, dim 0 the image's slot."""


Draws = Union[torch.Generator, SlotStreams]


def uniform(draws: Draws, shape, device) -> torch.Tensor:
    """Uniforms in [0, 1) of `shape` (the engine's streams: in (0, 1))."""
    if isinstance(draws, torch.Generator):
        return torch.rand(shape, generator=draws, device=device)
    return draws.uniform(shape)


def gumbel(shape, generator: Draws, device) -> torch.Tensor:
    u = uniform(generator, shape, device)
    if isinstance(generator, torch.Generator):  # torch.rand may give 0; the engine's streams are inside (0, 1)
        u = u.clamp_(1e-20, 1.0)
    return -torch.log(-torch.log(u))


def categorical(probs: torch.Tensor, generator: Draws) -> torch.Tensor:
    """(..., K) -> (...) index of one draw per row (Gumbel-max: exact; zero-probability entries never win)."""
    return (probs.log() + gumbel(probs.shape, generator, probs.device)).argmax(-1)


def draw(dist: Support, greedy: bool, generator: Draws) -> torch.Tensor:
    """(..., K) support -> (...) token ids: its argmax, or one draw."""
    pick = dist.probs.argmax(-1) if greedy else categorical(dist.probs, generator)
    return dist.ids.gather(-1, pick[..., None])[..., 0]


def candidates(dist: Support, n: int, greedy: bool, generator: Draws) -> tuple[torch.Tensor, torch.Tensor]:
    """n children of a node: the top n (greedy) or n draws without replacement, in draw order (Gumbel top-k).
    Returns tokens (..., n) and valid (..., n): False where the distribution had fewer than n tokens."""
    n_take = min(n, dist.probs.shape[-1])
    keys = dist.probs.log()
    if not greedy:
        keys = keys + gumbel(keys.shape, generator, keys.device)
    top = torch.topk(keys, n_take, dim=-1)
    tokens, valid = dist.ids.gather(-1, top.indices), torch.isfinite(top.values)
    if n_take < n:  # a vocabulary smaller than the tree's fan-out
        pad = n - n_take
        tokens = torch.cat([tokens, tokens.new_zeros(*tokens.shape[:-1], pad)], -1)
        valid = torch.cat([valid, valid.new_zeros(*valid.shape[:-1], pad)], -1)
    return tokens, valid
