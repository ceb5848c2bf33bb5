"""What a generation holds at its peak, predicted before any work from the shapes alone, so that a request
that cannot fit is refused up front (Pipeline.check_fits, check_ladder_fits; `--method auto` before it measures).

The predicted peak is weights + KV cache (both exact from the shapes the runner allocates) + the larger of what a
decode step and the prefill hold besides: a step, its verify logits (rows x nodes x vocab, fp32), the forward's own
activations and the sampling/acceptance workspace (`step_workspace_bytes`, the one place its formula lives); the
prefill, the forward over the whole prefix (`prefill_bytes`: quadratic in the prompt's length, what decides a
long prompt's fit) + a fixed allowance for what a generation adds besides (RUNTIME_ALLOWANCE). Counts are in
elements, times the bytes of their dtype: 4 for fp32, 8 for int64, 1 for bool. Every part grows with the width,
so the widest width that fits is found by bisection (`widest_fitting`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

from lantern.decoding.config import method_preset
from lantern.decoding import jacobi
from lantern.decoding.relaxation import WORKSPACE_BYTES, links_bytes, walks_the_codebook

FP32, INT64, BOOL = 4, 8, 1
# what a first generation adds beyond its tensors (allocator arenas, the engine's small state, lazily built library
# buffers): 9 MiB on the embedded model's first AR generation on a CPU, so 32 MiB leaves room
RUNTIME_ALLOWANCE = 32 << 20


def step_workspace_bytes(images: int, cfg_rows: int, nodes: int, support: int, vocab: int, relax_k: int = 0,
                         drafting: str = "none", form: str = "bounded", children: int = 1, draft_width: int = 0,
                         coupled: bool = False, top_p: bool = False, window: int = 0, fan_width: int = 0) -> int:
    """Bytes the sampling and acceptance of one step hold at once, beyond the verify logits, for B = `images`
    images of `cfg_rows` rows each (2 with classifier-free guidance), N = `nodes` verified nodes per image,
    K = `support` tokens after top-k (the vocabulary V when off), a relaxation over `relax_k` = k neighbours (0:
    exact), drafting "none" (AR), "jacobi" (a window, `children` candidates a position where it branches;
    `coupled`: MC-SJD's Gumbel noise) or "tree" (a
    drafter's tree of `children` children per parent, drafted `draft_width` nodes per drafter step), relaxation
    `form` "bounded" or "paper"; a Jacobi `window` of L drafts fanned past a cut support draws from `fan_width` W
    tokens (lantern.decoding.jacobi.fan_width; 0: no fan mixture).

    Derived from the code (lantern.decoding.sampling, acceptance, relaxation, jacobi, drafting), term by term, as
    an upper bound; nothing is quadratic in K or K x k:
    - guidance: u + s * (c - u) holds two (B, N, V) fp32 temporaries, then the guided logits (CFG only);
    - warp: logits / per-image temperature, (B, N, V); top-k's values and ids and the softmax, (B, N, K)
      fp32 + int64 + fp32 (top-p: its cumsum and mask, two more fp32); trees warp the gathered parents: one
      more (B, N, V) copy;
    - finding tokens in a support (SupportLookup): its ids sorted with their order, int64 each, the binary
      search's positions, int64, its hits, bool, and the probabilities read, fp32: about 33 bytes per (B, N, K)
      element; the exact test keeps about ten (B, N, K) fp32 per sibling besides;
    - MC-SJD's fixed noise is hashed from (seed, position, token) when read: a few (B, N, K) temporaries;
    - the bounded relaxation: about eight (B, N, K) fp32 per node, and its neighbour lists read in blocks of at
      most lantern.decoding.relaxation.WORKSPACE_BYTES, plus, where a wide support walks the codebook, the
      rule's lists both ways (links_bytes, kept from the first step on); the papers' form: a lookup and k
      neighbours' mass per sibling;
    - a fan past a cut support: the window's nodes' logits gathered (rows x L x V), guided (two temporaries and
      the result, as above) and tempered, (B, L, V) fp32 each; the top W, the mixture and its lookup on (B, L, W);
    - a drafter's tree: the drafter's logits (rows x W x V), their guidance and warp, and EAGLE-2's candidate
      test through a lookup."""
    b, n, k, v = images, nodes, support, vocab
    lookup = 33 * b * n * k
    guided = 2 * b * n * v * FP32 if cfg_rows > 1 else 0
    topk = b * n * k * (FP32 + INT64 + FP32) if k < v else b * n * v * FP32
    warp = b * n * v * FP32 + topk + (2 * b * n * k * FP32 if top_p else 0)
    total = guided + warp
    if drafting == "jacobi":
        total += lookup + 4 * b * n * k * FP32
        if children > 1:  # a branching window: its candidates' ranking, and the siblings' test as a tree's
            total += b * n * k * (FP32 + INT64) + 10 * b * n * k * FP32
        if coupled:  # the keyed noise's hash, a few int64 and fp32 (B, L, K) at once; nothing kept
            total += 4 * b * n * k * (FP32 + INT64)
        if fan_width:
            total += (cfg_rows + 4) * b * window * v * FP32 + b * window * fan_width * (33 + 4 * FP32 + INT64)
    elif drafting == "tree":
        total += b * n * v * FP32 + lookup + 10 * b * n * k * FP32  # parents' warp copy, q's lookup, siblings
        w = max(draft_width, 1)
        total += cfg_rows * b * w * v * FP32 + 3 * b * w * v * FP32 + 33 * b * w * k
    if relax_k and drafting != "none":
        if form == "paper":
            total += lookup + b * n * relax_k * (INT64 + 2 * FP32)
        else:
            total += 8 * b * n * k * FP32 + WORKSPACE_BYTES
            total += links_bytes(v, relax_k) if walks_the_codebook(k, v, relax_k) else 0  # K: the most receivers
    return total


def activation_bytes(rows: int, nodes: int, slots: int, heads: int, dim: int, ffn: int) -> int:
    """The verify forward's own transients, fp32 (an upper bound at narrower dtypes): attention's bias, scores
    and weights (rows, heads, N, S), and one layer's q/k/v, output and SwiGLU hidden (rows, N, ...)."""
    return rows * heads * nodes * slots * 3 * FP32 + rows * nodes * (5 * dim + 3 * ffn) * FP32


def prefill_bytes(rows: int, prefix: int, slots: int, heads: int, dim: int, ffn: int) -> int:
    """The prefill's transients over a prefix of `prefix` tokens, beyond the KV cache: the forward's activations
    at P = `prefix` nodes over `slots` cache slots (its features (rows, P, D) among them, kept for the drafter),
    the engine's causal mask and its per-row copy (rows, P, S) bool, the attention bias (rows, 1, P, S) and, for
    left-padded prompt rows, the positions' hidden-slot tests (rows, P, P) bool, three at once."""
    return (activation_bytes(rows, prefix, slots, heads, dim, ffn) + rows * prefix * slots * (2 * BOOL + FP32)
            + 3 * rows * prefix * prefix * BOOL)


@dataclass(frozen=True)
class PeakPrediction:
    """A request's predicted peak and its parts, in bytes."""

    weights_bytes: int
    kv_cache_bytes: int
    logits_bytes: int
    activation_bytes: int
    workspace_bytes: int
    prefill_bytes: int = 0  # held instead of a step's logits, activations and workspace, while the prefix runs
    runtime_bytes: int = RUNTIME_ALLOWANCE

    @property
    def step_bytes(self) -> int:
        """What a decode step holds beyond the weights and the KV cache."""
        return self.logits_bytes + self.activation_bytes + self.workspace_bytes

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + max(self.step_bytes, self.prefill_bytes)
                + self.runtime_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def kv_cache_bytes(spec, model_config, itemsize: int, spare: int = 1) -> int:
    """The target's cache and (with draft widths) the drafter's one layer, as lantern.backends.torch_steps
    make_caches allocates them: (rows * kv_heads * (max_len + spare), head_dim) per k and v per layer. spare: the
    slot cpu-graph's bounded attention adds (counted everywhere: one slot too many elsewhere)."""
    layers = model_config.n_layer + (1 if spec.draft_widths else 0)
    rows = spec.batch * model_config.kv_heads * (spec.max_len + spare)
    return 2 * layers * rows * model_config.head_dim * itemsize


def predict_peak(dcfg, model_config, spec, weights_bytes: int, itemsize: int, images: int) -> PeakPrediction:
    """The peak of a generation of `images` images per step with decode config `dcfg` on runner shape `spec`."""
    sampling, strategy = dcfg.sampling, dcfg.strategy
    v, n, rows = model_config.vocab_size, dcfg.verify_width, sampling.rows_per_image
    drafting = "none" if strategy is None else "jacobi" if dcfg.jacobi else "tree"
    relaxed = dcfg.acceptance != "exact"
    children = (dcfg.dynamic_top_k if dcfg.drafting == "dynamic" else strategy.tree.max_children
                if drafting == "tree" else strategy.branching if drafting == "jacobi" else 1)
    workspace = step_workspace_bytes(images, rows, n, sampling.support_size(v), v, relax_k=dcfg.k if relaxed else 0,
                                     drafting=drafting, form=dcfg.form, children=children,
                                     draft_width=strategy.level_width if strategy is not None else 0,
                                     coupled=dcfg.jacobi and dcfg.coupling == "gumbel" and not sampling.greedy,
                                     top_p=sampling.top_p < 1.0,
                                     window=strategy.window if drafting == "jacobi" else 0,
                                     fan_width=(jacobi.fan_width(strategy.tree, sampling, v)
                                                if drafting == "jacobi" else 0))
    dim = model_config.dim
    # query heads: width over head size; a family config without a SwiGLU width: 3 * dim (above LLaMA's 8/3)
    layout = (spec.max_len, dim // model_config.head_dim, dim, getattr(model_config, "ffn_hidden", 3 * dim))
    return PeakPrediction(weights_bytes=weights_bytes, kv_cache_bytes=kv_cache_bytes(spec, model_config, itemsize),
                          logits_bytes=spec.batch * n * v * FP32,
                          activation_bytes=activation_bytes(spec.batch, n, *layout), workspace_bytes=workspace,
                          prefill_bytes=prefill_bytes(spec.batch, spec.prefix_len, *layout))


class MemoryRefused(ValueError):
    """A request whose predicted peak exceeds the memory available (a ValueError: the CLI exits 2)."""


def size(nbytes: int) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.1f} MiB"


def widest_fitting(needed: Callable[[int], int], below: int, available: int, least: int = 1) -> Optional[int]:
    """The largest n in least..below with needed(n) <= available, or None: by bisection, `needed` being
    non-decreasing in n (every part of a prediction grows with the width and with the prefix), so a request
    200000 images wide is answered after about 18 predictions."""
    low, high = least - 1, below  # needed(low) fits, or low is below least; the answer is in low..high
    while low < high:
        middle = (low + high + 1) // 2
        if needed(middle) <= available:
            low = middle
        else:
            high = middle - 1
    return low if low >= least else None


def refusal(dcfg, width: int, needed, available: int, source: str, prediction: PeakPrediction,
            what: str = "this request", still: Optional[int] = None, fits: tuple[str, ...] = ()) -> MemoryRefused:
    """The refusal of `dcfg` at `width` images per step, naming what would fit: the widest smaller --batch, the
    widest smaller --top-k (powers of two), and AR where a speculative method was asked for, after the caller's
    own `fits` (e.g. a shorter --max-prompt-tokens). needed(dcfg, width): the bytes such a request has to
    allocate, non-decreasing in the width; still: what this one still has to (default needed(dcfg, width));
    what: what is refused."""
    fits = list(fits)
    batch = widest_fitting(lambda w: needed(dcfg, w), width - 1, available)
    if batch is not None:
        fits.append(f"--batch {batch} (batch={batch})")
    support = dcfg.sampling.top_k or 0
    top_k = support // 2 if support else 2 ** 20
    while top_k >= 1:
        narrower = replace(dcfg, sampling=replace(dcfg.sampling, top_k=top_k))
        if narrower.sampling.top_k < (support or top_k + 1) and needed(narrower, width) <= available:
            fits.append(f"--top-k {top_k}")
            break
        top_k //= 2
    if dcfg.speculative and needed(method_preset("ar", dcfg.sampling), width) <= available:
        fits.append("--method ar")
    parts = ", ".join(f"{name.removesuffix('_bytes').replace('_', ' ')} {size(value)}"
                      for name, value in prediction.to_dict().items() if name != "total_bytes")
    advice = ("it would fit with " + ", or ".join(fits) if fits else
              "no smaller batch, top-k or AR fits either: free memory or use a machine with more")
    still = needed(dcfg, width) if still is None else still
    return MemoryRefused(f"{what} cannot fit: its predicted peak at {width} image(s) per step is "
                         f"{size(prediction.total_bytes)} ({parts}), {size(still)} of it still to be "
                         f"allocated, and {size(available)} is available ({source}); {advice}")
