"""`--relaxation paper` is LANTERN's rule: on the trees, distributions and uniforms recorded from jadohu/LANTERN's
own `evaluate_posterior` (EAGLE-2 path: deterministic drafts) and `evaluate_posterior_v1` (static path: sampled
drafts), lantern accepts the same tokens and draws its bonus token from the same distribution.

The fixture (tests/golden/lantern_paper_rule.pt) was written by a recording script outside this repository that
imports LANTERN's `EaModel` (transformers 4.x) and calls those two methods on small seeded trees over a random
2-D codebook (LANTERN's `generate_codebook.py` neighbour order), recording the uniforms its `random.random()`
returned, each with the (level, path, token) it tested. It holds inputs (tree, target and drafter logits, top-k,
k, delta, the neighbour table) and outputs (accepted length and tokens, `sample_p`); its `source` and
`recorded_with` name LANTERN's commit and the versions. lantern is fed the same uniforms at the same candidates; its bonus token is drawn by
Gumbel-max with known uniforms, so each of BONUS_DRAWS draws must be the one LANTERN's `sample_p` gives."""
from pathlib import Path

import pytest
import torch

from lantern.decoding.acceptance import Acceptance, DraftedTree, accept
from lantern.decoding.sampling import SamplingConfig, warp

FIXTURE = Path(__file__).resolve().parents[1] / "golden" / "lantern_paper_rule.pt"
BONUS_DRAWS = 256  # rows of one batch: the same tree and acceptance uniforms, a different bonus draw each


def rule_of(case: dict, nearest: torch.Tensor) -> Acceptance:
    """LANTERN's (lantern_k, lantern_delta): a delta above 1 is LANTERN++'s lambda."""
    if case["delta"] > 1.0:
        return Acceptance("lantern++", k=case["k"], lam=case["delta"], form="paper", proximity=nearest)
    return Acceptance("lantern", k=case["k"], delta=case["delta"], form="paper", proximity=nearest)


def drafted_tree(trial: dict, rows: int, sampling: SamplingConfig) -> DraftedTree:
    """The recorded tree (a parent per node, node 0 the root) as lantern's buffers, `rows` copies."""
    parents, tokens = trial["parents"], torch.tensor(trial["tokens"])
    n = len(parents)
    depth, rank, kids = [0] * n, [-1] * n, {}
    for node in range(1, n):
        depth[node] = depth[parents[node]] + 1
        kids.setdefault(parents[node], []).append(node)
        rank[node] = len(kids[parents[node]]) - 1
    rows_of = sorted(kids)  # the nodes with children
    width = max(len(c) for c in kids.values())
    children = torch.tensor([kids[p] + [-1] * (width - len(kids[p])) for p in rows_of])
    ancestors = torch.eye(n, dtype=torch.bool)
    for node in range(1, n):
        ancestors[node] |= ancestors[parents[node]]
    q = None
    if trial["case"]["path"] == "static":  # what each parent's children were drawn from
        q = warp(trial["draft_logits"][rows_of].expand(rows, -1, -1), sampling)
    return DraftedTree(tokens=tokens.expand(rows, n), valid=torch.ones(rows, n, dtype=torch.bool),
                       depth=torch.tensor([depth]), ancestors=ancestors[None], parents=torch.tensor([rows_of]),
                       children=children[None], q=q, max_depth=max(depth), rank=torch.tensor([rank]))


class RecordedDraws:
    """The uniforms LANTERN drew, each at the candidate it tested (others: never reached); then the bonus draw's
    uniforms from a seeded generator, kept to recompute the draw from LANTERN's `sample_p`."""

    def __init__(self, trial: dict, tree: DraftedTree):
        self.trial, self.tree, self.bonus_uniforms = trial, tree, None
        self.calls = 0

    def uniform(self, shape):
        self.calls += 1
        if self.calls == 1:  # one per candidate slot (B, M, C)
            u = torch.full(shape, 0.5)
            rows = self.tree.parents[0].tolist()
            for (level, path, token), r in zip(self.trial["draws"], self.trial["uniforms"]):
                node = self.trial["path_nodes"][path][level]
                assert int(self.tree.tokens[0, node]) == token
                parent = self.trial["parents"][node]
                u[:, rows.index(parent), int(self.tree.rank[0, node])] = r
            return u
        self.bonus_uniforms = torch.rand(shape, generator=torch.Generator().manual_seed(self.calls))
        return self.bonus_uniforms


def lantern_on(trial: dict):
    case = trial["case"]
    sampling = SamplingConfig(top_k=case["top_k"])
    vocab = trial["target_logits"].shape[-1]
    tree = drafted_tree(trial, BONUS_DRAWS, sampling)
    p_nodes = warp(trial["target_logits"].expand(BONUS_DRAWS, -1, -1), sampling)
    draws = RecordedDraws(trial, tree)
    out = accept(p_nodes, tree, rule_of(case, RECORD["tables"][trial["table"]]), False, draws, vocab)
    return out, tree, p_nodes, draws


RECORD = torch.load(FIXTURE, weights_only=False)
TRIALS = RECORD["trials"]


@pytest.mark.parametrize("t", range(len(TRIALS)),
                         ids=[f"{t['case']['path']}-V{t['case']['vocab']}-topk{t['case']['top_k']}-k{t['case']['k']}"
                              f"-d{t['case']['delta']}-{i}" for i, t in enumerate(TRIALS)])
def test_paper_form_accepts_and_draws_as_lantern(t):
    trial = TRIALS[t]
    out, tree, p_nodes, draws = lantern_on(trial)
    m = trial["accepted"]
    assert torch.all(out.accepted == m), (out.accepted[0], m)
    path_tokens = tree.tokens.gather(1, out.path)[:, 1:m + 1]
    assert torch.equal(path_tokens, torch.tensor(trial["accepted_tokens"], dtype=torch.long).expand_as(path_tokens))
    # the bonus: Gumbel-max over the support of p where the walk stopped, with LANTERN's sample_p in place of
    # lantern's own distribution, must pick the token lantern picked, in every row
    final = out.path.gather(1, out.accepted[:, None])
    ids = p_nodes.ids.gather(1, final[..., None].expand(-1, -1, p_nodes.ids.shape[-1]))[:, 0]  # (B, K)
    reference = trial["sample_p"][ids]
    assert float(reference.sum(-1).min()) > 1 - 1e-5  # LANTERN's sample_p lies on that support
    noise = -torch.log(-torch.log(draws.bonus_uniforms[:, 0].clamp(1e-20, 1.0)))
    want = ids.gather(1, (reference.log() + noise).argmax(-1, keepdim=True))[:, 0]
    assert torch.equal(out.bonus, want), f"{int((out.bonus != want).sum())} of {BONUS_DRAWS} bonus draws differ"


def test_the_fixture_exercises_rejections_boosts_and_both_paths():
    """The recorded trials reject candidates after a boost (the step that clears neighbours), accept some
    drafts, and cover both paths, top-k supports and LANTERN++."""
    paths = {t["case"]["path"] for t in TRIALS}
    assert paths == {"eagle2", "static"}
    assert any(t["case"]["top_k"] for t in TRIALS) and any(t["case"]["delta"] > 1 for t in TRIALS)
    assert sum(t["accepted"] > 0 for t in TRIALS) >= 10
    assert sum(len(t["draws"]) > t["accepted"] for t in TRIALS) >= 20  # rejections happened
