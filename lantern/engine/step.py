"""The one decode step, for every busy slot of a static-width batch, over any backend Runner.

    propose -> verify (one static-shape target forward over every slot's nodes) -> accept -> commit -> emit

Each slot holds one image: its root (the last accepted token, not yet in the cache) at position `root`, the
tokens emitted so far, its request's token limit and its random stream. A slot that is not running (free,
or its image complete) rides along as padding: nothing it computes is emitted, committed or recorded, its
root and length stay frozen. Positions, lengths and masks are per-slot tensors, so every call keeps its static
shape; nothing here reads a value back to the host. A new request enters its slot through `prefill`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lantern.backends.base import Runner, StaticSpec
from lantern.decoding.acceptance import Acceptance, DraftedTree
from lantern.decoding.config import DecodeConfig
from lantern.decoding.drafting import PrefixPairs, on_rows, window_mask
from lantern.decoding.sampling import draw, target_support
from lantern.engine.draws import SlotDraws
from lantern.engine.host_values import to_device
from lantern.engine.proposers import Proposer, Stepped
from lantern.engine.slot_records import SlotRecords


def static_spec(dcfg: DecodeConfig, model_config, batch: int, dtype: str, draft_prefix: int = 0) -> StaticSpec:
    """Every shape the step uses for `batch` slots (B, a static width of the runner). draft_prefix: the prefix
    pairs the drafter reads at prefill (lantern.models.drafter.prefix_pairs; a draft step of its own width)."""
    rows = dcfg.sampling.rows_per_image * batch
    p = model_config.cls_token_num
    strategy = dcfg.strategy
    if strategy is None:
        return StaticSpec(batch=rows, max_len=_round8(p + model_config.block_size), prefix_len=p,
                          verify_widths=(dcfg.verify_width,), dtype=dtype, commit_width=1)
    prefix = draft_prefix if strategy.draft_widths else 0
    widths = strategy.draft_widths + ((prefix,) if prefix and prefix not in strategy.draft_widths else ())
    return StaticSpec(batch=rows, max_len=_round8(p + model_config.block_size + strategy.scratch), prefix_len=p,
                      verify_widths=(dcfg.verify_width,), draft_widths=widths, dtype=dtype,
                      commit_width=strategy.commit_pairs, draft_prefix=prefix)


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def acceptance_rule(dcfg: DecodeConfig, proximity: Optional[torch.Tensor], device) -> Acceptance:
    """The decode config's acceptance rule with its proximity table placed on `device` once (read every step)."""
    near = proximity.to(device) if proximity is not None else None  # its compact integer type, indexed directly
    return Acceptance(dcfg.acceptance, k=dcfg.k, delta=dcfg.delta, lam=dcfg.lam, form=dcfg.form, proximity=near)


@dataclass
class Slots:
    """The device state of every slot, (B, ...) each."""

    cond: torch.Tensor  # (B,) class ids or (B, P, C) caption embeddings: each slot's condition
    root: torch.Tensor  # (B,) the root's position
    root_tok: torch.Tensor  # (B,)
    emitted: torch.Tensor  # (B,) tokens decided so far
    limit: torch.Tensor  # (B,) tokens the slot's request wants
    busy: torch.Tensor  # (B,) bool: a request holds the slot
    out: torch.Tensor  # (B, block + D + 2) tokens; the last column absorbs padding
    draws: SlotDraws
    records: SlotRecords

    @classmethod
    def allocate(cls, runner: Runner, width: int, depth: int, cond: torch.Tensor, draws: SlotDraws) -> "Slots":
        dev, block = runner.device, runner.model_config.block_size
        long = dict(dtype=torch.long, device=dev)
        return cls(cond=to_device(cond, dev), root=torch.full((width,), runner.spec.prefix_len, **long),
                   root_tok=torch.zeros(width, **long), emitted=torch.zeros(width, **long),
                   limit=torch.zeros(width, **long), busy=torch.zeros(width, dtype=torch.bool, device=dev),
                   out=torch.zeros(width, block + depth + 2, **long), draws=draws,
                   records=SlotRecords(width, block, depth, dev))


def condition_rows(cond: torch.Tensor, dcfg: DecodeConfig, null: torch.Tensor) -> torch.Tensor:
    """[cond; uncond] rows for CFG (LlamaGen's layout), or cond alone. null: the null condition, one per image."""
    return torch.cat([cond, null]) if dcfg.sampling.use_cfg else cond


def prefill(runner: Runner, proposer: Proposer, slots: Slots, null: torch.Tensor, fresh: torch.Tensor,
            prefix: Optional[PrefixPairs] = None) -> None:
    """New requests hold the `fresh` (B,) slots (their condition, seed and limit already placed): one
    static-shape prefill of every row, of which only the fresh rows' results are kept. A busy row's prefix is
    rewritten with what it held (its own condition, the same computation), so its image goes on unchanged.
    prefix: what a drafter that reads the prefix pairs with its features, every row (None: it reads none)."""
    spec, dev, sc = runner.spec, runner.device, proposer.sampling
    with runner.phase("prefill"):
        s = torch.arange(spec.max_len, device=dev)
        mask = s[None, :] <= torch.arange(spec.prefix_len, device=dev)[:, None]  # (P, S) causal over the prefix
        rows = condition_rows(slots.cond, proposer.dcfg, null)
        out = runner.prefill(rows, mask[None].expand(spec.batch, -1, -1).contiguous())
        logits = out.logits[:, -1]  # (R*B, V)
        slots.draws.begin()
        first = target_support(logits, sc)  # (B, K)
        tok = draw(first, sc.greedy, slots.draws)
        slots.root_tok = torch.where(fresh, tok, slots.root_tok)
        slots.root = torch.where(fresh, spec.prefix_len, slots.root)
        slots.emitted = torch.where(fresh, 1, slots.emitted)
        slots.out[:, 0] = torch.where(fresh, tok, slots.out[:, 0])
        slots.records.admit(fresh)
        proposer.reset(slots, fresh, first, out.hidden, prefix)  # features (R*B, P, D)


@dataclass(frozen=True)
class StepCounts:
    """What one decode step did, counted over its slots. On the device it is one (D + 4,) int64 tensor (`pack`:
    a fused step's graph returns one tensor, and the engine reads it in the step's one host transfer); on the
    host, these fields (`unpack`)."""

    drafting: int  # requests that offered drafts
    draft_tokens: int  # drafted tokens offered for verification
    accepted: int  # drafted tokens accepted (bonus tokens not counted)
    running: int  # images that stepped
    per_depth: list[int]  # requests accepting a draft at depth 1 .. D

    @staticmethod
    def pack(drafting, draft_tokens, accepted, running, per_depth: torch.Tensor) -> torch.Tensor:
        """Each slot's counts, (B,) each and per_depth (B, D) (integers or flags) -> their sums over the slots, in
        one sum."""
        return torch.cat([torch.stack([drafting, draft_tokens, accepted, running], 1), per_depth], 1).sum(0)

    @classmethod
    def unpack(cls, values: list, depth: int) -> tuple[StepCounts, list]:
        """The counts at the head of `values` (a packed report read to the host, then what followed it), and the
        rest of `values`."""
        drafting, draft_tokens, accepted, running = (int(v) for v in values[:4])
        return cls(drafting, draft_tokens, accepted, running, values[4:4 + depth]), values[4 + depth:]


def decode_step(runner: Runner, proposer: Proposer, slots: Slots) -> torch.Tensor:
    """Every running slot moves on by one step. Returns this step's StepCounts, packed, on the device."""
    spec, dev, rows = runner.spec, runner.device, proposer.sampling.rows_per_image
    depth = proposer.depth
    running = slots.busy & (slots.emitted < slots.limit)
    slots.draws.begin(running)  # a running slot's stream moves on to its next step
    tree = proposer.propose(slots)
    b, n = tree.tokens.shape
    # at most limit - emitted - 1 drafts fit in the image; slots not running accept none
    room = torch.where(running, slots.limit - slots.emitted - 1, -1)
    tree.valid = tree.valid & (tree.depth <= room[:, None])
    with runner.phase("verify"):
        out = _verify(runner, tree, slots.root, n, torch.arange(spec.max_len, device=dev), rows)
        p_nodes = proposer.distributions(out.logits)
    with runner.phase("accept"):
        acc = proposer.accept(p_nodes, tree)
    m = torch.where(running, acc.accepted, -1)  # slots not running: nothing to emit or commit
    steps = torch.arange(depth + 1, device=dev)
    if proposer.commits:
        with runner.phase("commit"):
            dst = slots.root[:, None] + steps  # (B, D+1)
            src = torch.where(steps[None] <= m[:, None], slots.root[:, None] + acc.path, dst)  # padding: itself
            runner.commit(on_rows(src, rows), on_rows(dst, rows))
    drafted = tree.tokens.gather(1, acc.path[:, 1:])
    new_tokens = torch.where(steps[None] < m[:, None], torch.cat([drafted, acc.bonus[:, None]], 1),
                             acc.bonus[:, None])  # (B, D+1): the accepted drafts, then the bonus
    col = torch.where(steps[None] <= m[:, None], slots.emitted[:, None] + steps, slots.out.shape[1] - 1)
    slots.out.scatter_(1, col, new_tokens)
    slots.records.add(running, acc, tree.rank.expand(b, -1))
    advance = torch.where(running, m + 1, 0)
    slots.root_tok = torch.where(running, acc.bonus, slots.root_tok)
    slots.root, slots.emitted = slots.root + advance, slots.emitted + advance
    proposer.advance(slots, Stepped(tree, acc, out, p_nodes, running, m, new_tokens, advance))
    drafts = tree.valid[:, 1:].sum(-1)  # (B,) draft tokens offered
    accepted = torch.where(running, acc.accepted, 0)
    return StepCounts.pack(drafting=running & (drafts > 0), draft_tokens=torch.where(running, drafts, 0),
                           accepted=accepted, running=running, per_depth=accepted[:, None] >= steps[None, 1:])


def _verify(runner: Runner, tree: DraftedTree, root: torch.Tensor, n: int, slots: torch.Tensor, rows: int):
    """One target forward over every slot's N nodes: node i at position root + depth(i), cache slot root + i."""
    b = root.shape[0]
    positions = root[:, None] + tree.depth.expand(b, -1)
    node_slots = root[:, None] + torch.arange(n, device=root.device)
    mask = window_mask(tree.ancestors, root, slots[None] < root[:, None])  # committed cache + own ancestors
    return runner.verify(on_rows(tree.tokens, rows), on_rows(positions, rows), on_rows(node_slots, rows),
                         on_rows(mask, rows))
