"""Many independent trials of one node's acceptance, as one batch: row b is trial b.

The measuring instrument of the acceptance rules (tests and tools/relaxation_tvd.py): a root with n children
drawn from q (without replacement, or its top n), every child a leaf. What the node outputs first is the
accepted child or, when every child is rejected, the bonus drawn from the residual.
"""
from __future__ import annotations

import torch

from lantern.decoding.acceptance import Acceptance, DraftedTree, StepAcceptance, accept
from lantern.decoding.sampling import Support, candidates


def full_support(p: torch.Tensor) -> Support:
    """(..., V) dense probabilities as a support over the whole vocabulary."""
    return Support(p, torch.arange(p.shape[-1], device=p.device).expand(p.shape).contiguous())


def one_node_trials(p: torch.Tensor, q: torch.Tensor, n_children: int, rule: Acceptance, trials: int, seed: int,
                    deterministic: bool = False, greedy: bool = False) -> tuple[torch.Tensor, StepAcceptance]:
    """p, q (V,) target and draft distributions. Returns the first output token of every trial (trials,) and
    the raw acceptance results."""
    g = torch.Generator().manual_seed(seed)
    v, n = p.shape[0], n_children + 1
    qs = full_support(q.expand(trials, 1, v))
    kids, ok = candidates(qs, n_children, deterministic or greedy, g)  # (B, 1, C)
    tokens = torch.cat([torch.zeros(trials, 1, dtype=torch.long), kids[:, 0]], 1)
    valid = torch.cat([torch.ones(trials, 1, dtype=torch.bool), ok[:, 0]], 1)
    ancestors = torch.eye(n, dtype=torch.bool)
    ancestors[:, 0] = True
    tree = DraftedTree(tokens=tokens, valid=valid, depth=torch.tensor([[0] + [1] * n_children]),
                       ancestors=ancestors[None], parents=torch.tensor([[0]]),
                       children=torch.arange(1, n)[None, None], q=None if deterministic or greedy else qs,
                       max_depth=1, rank=torch.arange(-1, n_children)[None])
    top = torch.topk(p, int((p > 0).sum()))  # p's support: the walk never needs more (top-k zeroed the rest)
    k = top.values.shape[0]
    leaves = torch.full((n_children, k), 1.0 / k)  # irrelevant: only the first output token is read
    p_nodes = Support(torch.cat([top.values[None], leaves]).expand(trials, n, k),
                      top.indices.expand(trials, n, k))
    out = accept(p_nodes, tree, rule, greedy, g, v)
    first = tokens.gather(1, out.path[:, 1:2])[:, 0]
    return torch.where(out.accepted > 0, first, out.bonus), out
