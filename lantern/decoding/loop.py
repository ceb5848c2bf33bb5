"""The decode loops over any backend Runner, for a batch of B images, on the runner's device.

AR: one target forward per token for all B images. Speculative, per step for all B images at once:
  catch-up (the drafter eats each image's newly accepted pairs) -> draft a tree per image -> verify every
  image's tree in one static-shape target forward -> acceptance as a tensor program -> commit each image's
  accepted path inside the KV cache -> its bonus token is the image's new root.
Images finish at different steps; a finished image keeps running as padding (its root and length frozen,
nothing it computes is kept), so every shape stays static. Per step only the "is any image still running"
flag crosses to the host; statistics stay on the device until the end.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from lantern.backends.base import Runner, StaticSpec
from lantern.decoding.acceptance import Acceptance, DraftedTree, accept, accept_chain
from lantern.decoding.config import DecodeConfig
from lantern.decoding.drafting import Drafter, draft_dynamic, draft_static, on_rows, window_mask
from lantern.decoding.sampling import GuidedLogits, SamplingConfig, combine_cfg, draw, target_support
from lantern.decoding.stats import GenerationStats, StepRecords
from lantern.decoding.strategy import StaticTree


def static_spec(dcfg: DecodeConfig, model_config, batch: int, dtype: str) -> StaticSpec:
    """Every shape the loops below use for `batch` images (B, a static width of the runner)."""
    rows = dcfg.sampling.rows_per_image * batch
    p = model_config.cls_token_num
    strategy = dcfg.strategy
    if strategy is None:
        return StaticSpec(batch=rows, max_len=_round8(p + model_config.block_size), prefix_len=p,
                          verify_widths=(dcfg.verify_width,), dtype=dtype, commit_width=1)
    return StaticSpec(batch=rows, max_len=_round8(p + model_config.block_size + strategy.scratch), prefix_len=p,
                      verify_widths=(dcfg.verify_width,), draft_widths=strategy.draft_widths, dtype=dtype,
                      commit_width=strategy.commit_pairs)


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def condition_rows(cond: torch.Tensor, dcfg: DecodeConfig, null: torch.Tensor) -> torch.Tensor:
    """[cond; uncond] rows for CFG (LlamaGen's layout), or cond alone. null: the null condition, one per image."""
    return torch.cat([cond, null]) if dcfg.sampling.use_cfg else cond


def prefill(runner: Runner, rows: torch.Tensor):
    """The prefix of every row (causal over it) -> the last position's logits and features."""
    spec, dev = runner.spec, runner.device
    slots = torch.arange(spec.max_len, device=dev)
    mask = slots[None, :] <= torch.arange(spec.prefix_len, device=dev)[:, None]  # (P, S) causal over the prefix
    out = runner.prefill(rows.to(dev), mask[None].expand(spec.batch, -1, -1).contiguous())
    return out.logits[:, -1], out.hidden[:, -1]  # (R*B, V), (R*B, D)


def acceptance_rule(dcfg: DecodeConfig, proximity: Optional[torch.Tensor], device) -> Acceptance:
    """The decode config's acceptance rule with its proximity table placed on `device` (as int64, read every
    step). Build it once per pipeline and configuration: a relaxed rule builds its neighbourhood bitset on first
    use, which costs more than a whole step."""
    near = proximity.to(device) if proximity is not None else None  # its compact integer type, indexed directly
    return Acceptance(dcfg.acceptance, k=dcfg.k, delta=dcfg.delta, lam=dcfg.lam, form=dcfg.form, proximity=near)


def make_generator(runner: Runner, seed: int) -> torch.Generator:
    """The one seeded generator of a generation, on the runner's device (same seed, same tokens)."""
    return torch.Generator(device=runner.device).manual_seed(seed)


@torch.inference_mode()
def decode_ar(runner: Runner, cond_rows: torch.Tensor, dcfg: DecodeConfig, active: torch.Tensor, block: int,
              generator: torch.Generator) -> tuple[torch.Tensor, GenerationStats]:
    """Plain AR over B images: one target forward per token. active (B,) marks real images (the rest pad a
    short chunk). Returns tokens (B, block) and the stats of the active images."""
    sc, spec, dev = dcfg.sampling, runner.spec, runner.device
    b = active.shape[0]
    t0 = time.perf_counter()
    with runner.phase("prefill"):
        logits, _ = prefill(runner, cond_rows)
        tok = draw(target_support(logits, sc), sc.greedy, generator)  # (B,)
    out = torch.empty(b, block, dtype=torch.long, device=dev)
    out[:, 0] = tok
    slots = torch.arange(spec.max_len, device=dev)
    for t in range(1, block):
        pos = spec.prefix_len + t - 1  # sequence position of the token being fed
        positions = torch.full((spec.batch, 1), pos, device=dev)
        mask = (slots <= pos)[None, None].expand(spec.batch, 1, -1).contiguous()
        with runner.phase("decode"):
            o = runner.verify(on_rows(tok[:, None], sc.rows_per_image), positions, positions.clone(), mask)
            tok = draw(target_support(o.logits[:, 0], sc), sc.greedy, generator)
        out[:, t] = tok
    stats = GenerationStats.for_ar(int(active.sum()), block, time.perf_counter() - t0)
    return out.cpu(), stats


@torch.inference_mode()
def decode_speculative(runner: Runner, cond_rows: torch.Tensor, dcfg: DecodeConfig, active: torch.Tensor, block: int,
                       generator: torch.Generator, rule: Acceptance) -> tuple[torch.Tensor, GenerationStats]:
    """B images with a drafter, one batched step at a time; rule: `acceptance_rule(dcfg, ...)`. Returns tokens
    (B, block) and the stats of the active images (padding images of a short chunk start finished)."""
    sc, spec, dev = dcfg.sampling, runner.spec, runner.device
    strategy = dcfg.strategy
    drafter = Drafter(runner, sc, generator)
    b, n, depth = active.shape[0], strategy.verify_width, strategy.depth
    vocab = runner.model_config.vocab_size
    slots = torch.arange(spec.max_len, device=dev)
    t0 = time.perf_counter()
    with runner.phase("prefill"):
        logits, feat = prefill(runner, cond_rows)
        root_tok = draw(target_support(logits, sc), sc.greedy, generator)  # (B,)
    out = torch.zeros(b, block + depth + 2, dtype=torch.long, device=dev)  # the last column absorbs padding
    out[:, 0] = root_tok
    emitted = torch.where(active.to(dev), 1, block)  # (B,) tokens so far; padding images start finished
    root = torch.full((b,), spec.prefix_len, dtype=torch.long, device=dev)  # the root's position
    a = strategy.catchup_width
    pend_feats = feat[:, None].repeat(1, a, 1)  # (R*B, A, D) pairs for the next catch-up
    pend_tokens = root_tok[:, None].repeat(1, a)
    pend_count = torch.ones(b, dtype=torch.long, device=dev)
    draft = draft_static if isinstance(strategy, StaticTree) else draft_dynamic
    chain = isinstance(strategy, StaticTree) and strategy.tree.is_chain  # accepted without a tree walk
    records = StepRecords()
    steps = torch.arange(depth + 1, device=dev)
    chain_nodes = steps[None].expand(b, -1)  # a chain's node ids are its depths
    while True:
        running = emitted < block
        if not bool(running.any()):  # the one host sync of a step
            break
        with runner.phase("draft"):
            q_root, root_feat = drafter.catch_up(pend_feats, pend_tokens, pend_count, root)
            tree = draft(drafter, strategy, root_tok, root, q_root, root_feat)
        # at most block - emitted - 1 drafts fit in the image; finished images accept none
        limit = torch.where(running, block - emitted - 1, -1)
        tree.valid = tree.valid & (tree.depth <= limit[:, None])
        with runner.phase("verify"):
            out_step = _verify(runner, tree, root, n, slots, sc.rows_per_image)
            p_nodes = verify_distributions(out_step.logits, sc)
        with runner.phase("accept"):
            if chain:
                acc = accept_chain(p_nodes.index(chain_nodes), tree.tokens, tree.valid, tree.q, rule, sc.greedy,
                                   generator, vocab)
            else:
                acc = accept(p_nodes, tree, rule, sc.greedy, generator, vocab)
        m = torch.where(running, acc.accepted, -1)  # finished images: nothing to emit or commit
        with runner.phase("commit"):
            dst = root[:, None] + steps  # (B, D+1)
            src = torch.where(steps[None] <= m[:, None], root[:, None] + acc.path, dst)  # padding copies itself
            r = sc.rows_per_image
            runner.commit(on_rows(src, r), on_rows(dst, r))
        new_tokens = torch.cat([tree.tokens.gather(1, acc.path[:, 1:]), acc.bonus[:, None]], 1)  # (B, D+1)
        new_tokens = torch.where(steps[None] < m[:, None], new_tokens, acc.bonus[:, None])
        col = torch.where(steps[None] <= m[:, None], emitted[:, None] + steps, out.shape[1] - 1)
        out.scatter_(1, col, new_tokens)
        records.add(running, acc, tree.rank.expand(b, -1))
        pend_feats = out_step.hidden.gather(1, on_rows(acc.path, r)[..., None].expand(-1, -1, out_step.hidden.shape[-1]))
        pend_tokens, pend_count = new_tokens, torch.where(running, m + 1, pend_count)
        advance = torch.where(running, m + 1, 0)
        root_tok = torch.where(running, acc.bonus, root_tok)
        root, emitted = root + advance, emitted + advance
    stats = records.stats(active.cpu(), block, time.perf_counter() - t0)
    stats.draft_forwards = records.steps * strategy.drafter_calls
    return out[:, :block].cpu(), stats


def verify_distributions(logits: torch.Tensor, sc: SamplingConfig) -> GuidedLogits:
    """(R*B, N, V) verify logits -> each image's guided logits, warped where the acceptance reads them."""
    return GuidedLogits(combine_cfg(logits, sc.cfg_scale, sc.use_cfg), sc)


def _verify(runner: Runner, tree: DraftedTree, root: torch.Tensor, n: int, slots: torch.Tensor, rows: int):
    """One target forward over every image's N nodes: node i at position root + depth(i), slot root + i."""
    b = root.shape[0]
    positions = root[:, None] + tree.depth.expand(b, -1)
    node_slots = root[:, None] + torch.arange(n, device=root.device)
    mask = window_mask(tree.ancestors, root, slots[None] < root[:, None])  # committed cache + own ancestors
    return runner.verify(on_rows(tree.tokens, rows), on_rows(positions, rows), on_rows(node_slots, rows),
                         on_rows(mask, rows))
