"""The decode loops over any backend Runner: AR (a batch of images) and speculative (one image at a time).

Speculative step, with the root r = the last accepted token (not yet in the target cache):
  catch-up (drafter eats the newly accepted pairs) -> draft a tree -> verify the tree in one target
  forward -> walk the tree with the acceptance rule -> commit the accepted path's K/V -> bonus = new root.
Sampling, acceptance and tree bookkeeping run on the host; model math runs on the runner's device.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from lantern.backends.base import Runner, StaticSpec
from lantern.decoding.acceptance import Acceptance, walk_tree
from lantern.decoding.config import DecodeConfig
from lantern.decoding.drafting import DraftContext, catch_up, draft_dynamic, draft_static, on_rows
from lantern.decoding.sampling import combine_cfg, sample_from, warp
from lantern.decoding.stats import GenerationStats


def static_spec(dcfg: DecodeConfig, model_config, images: int, dtype: str) -> StaticSpec:
    """Every shape the loops below will use. Speculative decoding runs one image per step."""
    rows = dcfg.sampling.rows_per_image * (1 if dcfg.speculative else images)
    p, n = model_config.cls_token_num, dcfg.verify_width
    if not dcfg.speculative:
        return StaticSpec(batch=rows, max_len=_round8(p + model_config.block_size), prefix_len=p,
                          verify_widths=(1,), dtype=dtype, commit_width=1)
    catchup, width = dcfg.tree_depth + 1, dcfg.draft_width
    scratch = n + width + catchup if dcfg.drafting != "dynamic" else dcfg.dynamic_top_k * dcfg.dynamic_depth + width
    return StaticSpec(batch=rows, max_len=_round8(p + model_config.block_size + max(n, scratch) + catchup),
                      prefix_len=p, verify_widths=(n,), draft_widths=tuple(sorted({catchup, width})), dtype=dtype,
                      commit_width=catchup)


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def condition_rows(cond: torch.Tensor, dcfg: DecodeConfig, null: torch.Tensor) -> torch.Tensor:
    """[cond; uncond] rows for CFG (LlamaGen's layout), or cond alone."""
    return torch.cat([cond, null]) if dcfg.sampling.use_cfg else cond


def _prefill(runner: Runner, rows: torch.Tensor):
    spec = runner.spec
    p, s = spec.prefix_len, spec.max_len
    mask = torch.arange(s)[None, :] <= torch.arange(p)[:, None]  # (P, S) causal over the prefix
    out = runner.prefill(rows.to(runner.device), on_rows(mask, spec.batch, runner.device))
    return out.logits[:, -1].float().cpu(), out.hidden[:, -1]  # (R, V), (R, D)


def _choose(probs: torch.Tensor, greedy: bool, generator: torch.Generator) -> torch.Tensor:
    return probs.argmax(-1) if greedy else sample_from(probs, generator)


@torch.inference_mode()
def decode_ar(runner: Runner, cond_rows: torch.Tensor, dcfg: DecodeConfig, n_images: int, block: int,
              generator: torch.Generator) -> tuple[torch.Tensor, GenerationStats]:
    """Plain AR over a batch of images: one target forward per token. Returns tokens (n, block)."""
    sc, spec = dcfg.sampling, runner.spec
    stats = GenerationStats()
    s, dev = spec.max_len, runner.device
    t0 = time.perf_counter()
    with runner.phase("prefill"):
        logits, _ = _prefill(runner, cond_rows)
    stats.target_forwards += 1
    tok = _choose(warp(combine_cfg(logits, sc.cfg_scale, sc.use_cfg), sc), sc.greedy, generator)  # (n,)
    out = [tok]
    slot_ids = torch.arange(s)
    for t in range(1, block):
        pos = spec.prefix_len + t - 1  # sequence position of the token being fed
        positions = torch.full((spec.batch, 1), pos, device=dev)
        slots = positions.clone()  # its own tensor: graph backends key on inputs that alias each other
        mask = on_rows((slot_ids <= pos)[None], spec.batch, dev)
        with runner.phase("decode"):
            rows_tok = tok.repeat(sc.rows_per_image)[:, None]
            o = runner.verify(rows_tok.to(dev), positions, slots, mask)
            probs = warp(combine_cfg(o.logits[:, 0].float().cpu(), sc.cfg_scale, sc.use_cfg), sc)
            tok = _choose(probs, sc.greedy, generator)
        stats.target_forwards += 1
        out.append(tok)
    stats.tokens = n_images * block
    stats.wall_seconds = time.perf_counter() - t0
    return torch.stack(out, dim=1), stats


@torch.inference_mode()
def decode_speculative(runner: Runner, cond_rows: torch.Tensor, dcfg: DecodeConfig, block: int,
                       generator: torch.Generator, proximity: Optional[torch.Tensor]) -> tuple[torch.Tensor, GenerationStats]:
    """One image (its CFG rows) with a drafter: returns tokens (block,) and the stats."""
    sc, spec, dev = dcfg.sampling, runner.spec, runner.device
    k = min(dcfg.k, proximity.shape[1]) if proximity is not None else dcfg.k
    rule = Acceptance(dcfg.acceptance, k=k, delta=dcfg.delta, lam=dcfg.lam, proximity=proximity)
    tree = dcfg.static_tree()
    n = dcfg.verify_width
    ctx = DraftContext(runner, sc, spec.prefix_len, catchup_width=dcfg.tree_depth + 1, draft_width=dcfg.draft_width,
                       generator=generator)
    stats = GenerationStats()
    s, p = spec.max_len, spec.prefix_len
    slot_ids = torch.arange(s)
    t0 = time.perf_counter()
    with runner.phase("prefill"):
        logits, feat = _prefill(runner, cond_rows)
    stats.target_forwards += 1
    root = int(_choose(warp(combine_cfg(logits, sc.cfg_scale, sc.use_cfg), sc)[0], sc.greedy, generator))
    tokens = [root]
    r = p  # the root's position = the target cache length
    pending_feats, pending_tokens = feat[:, None], torch.tensor([root])
    while len(tokens) < block:
        with runner.phase("draft"):
            root_q, root_feat = catch_up(ctx, pending_feats, pending_tokens, r - pending_tokens.shape[0] + 1)
            if tree is not None:
                drafted = draft_static(ctx, tree, root, root_q, root_feat, r)
            else:
                drafted = draft_dynamic(ctx, dcfg.dynamic_depth, dcfg.dynamic_top_k, dcfg.dynamic_total, root, root_q,
                                        root_feat, r)
        t = drafted.tree
        with runner.phase("verify"):
            mask = (slot_ids < r)[None].repeat(n, 1)
            mask[:, r:r + n] = t.mask  # (N, S): the committed cache plus each node's ancestors
            b = spec.batch
            out = runner.verify(on_rows(drafted.tokens, b, dev), on_rows(r + t.node_depth, b, dev),
                                on_rows(r + torch.arange(n), b, dev), on_rows(mask, b, dev))
            p_nodes = warp(combine_cfg(out.logits.float().cpu(), sc.cfg_scale, sc.use_cfg), sc)[0]  # (N, V)
        stats.target_forwards += 1
        with runner.phase("accept"):
            walk = walk_tree(p_nodes, t.children, drafted.tokens, drafted.valid, drafted.q, rule, sc.greedy,
                             generator, max_accept=block - len(tokens) - 1)
        m = len(walk.path) - 1
        with runner.phase("commit"):
            width = spec.commit_pairs
            path = torch.tensor(walk.path)
            # pad with self-copies past the new length, so every dst is distinct and nothing valid is touched
            pad = r + m + 1 + torch.arange(width - m - 1)
            src = torch.cat([r + path, pad])
            dst = torch.cat([r + torch.arange(m + 1), pad])
            runner.commit(on_rows(src, spec.batch, dev), on_rows(dst, spec.batch, dev), "target")
        new_tokens = drafted.tokens[path[1:]].tolist() + [walk.bonus]
        tokens += new_tokens
        pending_feats = out.hidden[:, path]  # features of the root and the accepted nodes: (R, m+1, D)
        pending_tokens = torch.tensor(new_tokens)
        root = walk.bonus
        r += m + 1
        stats.accepted_lengths.append(m + 1)
        stats.depth_tried.update(walk.reached)
        stats.depth_accepted.update(range(1, m + 1))
        stats.moved_mass += walk.moved
        stats.accepted_ranks.append(tuple(t.rank[path[1:]].tolist()))
    stats.draft_forwards = ctx.draft_calls
    stats.tokens = block
    stats.wall_seconds = time.perf_counter() - t0
    return torch.tensor(tokens[:block]), stats
