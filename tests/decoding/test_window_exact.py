"""mc-sjd-pac's step, exactly: one verify of the branching window WindowTree(window=2, branching=K, branch_depth=2)
enumerated over every pair of ranked-draft tuples on a tiny vocabulary, with the drafts placed by the engine's own
Jacobi proposer and the library's own acceptance probabilities and residuals. The law of the first two committed
tokens equals AR's, p1(x1) p2(x2 | x1), to 1e-6; a broken step fails the same check by far more
(docs/algorithms.md, "Branching windows").

The step: window slot 0 (the token after the root) and slot 1 hold stale distributions q1, q2; the candidates at
depth d are the top K of log q_d + G_d, G_d the position's coupled noise, so K draws without replacement from q_d
(Plackett-Luce), and every parent at depth 1 has the same candidates at depth 2. The outcomes: two accepted nodes
commit (x1, x2); an accepted node then a bonus commits (x1, bonus); a bonus at depth 1 commits x1 = bonus, and the
next step starts after it, where the token is AR's p2(. | x1)."""
import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import lantern.decoding.acceptance as acceptance
from lantern.decoding import SamplingConfig, method_preset
from lantern.decoding.sampling import Support
from lantern.engine.draws import SlotDraws
from lantern.engine.proposers import WindowProposal
from lantern.engine.slot_sampling import SlotSampling
from lantern.engine.step import acceptance_rule
from test_speculative import LEVEL, pvalue

V = 6  # the vocabulary
ROOT = 2  # the committed root's token (what p1 is conditioned on; the tables stand for any)
EMITTED = 5  # the image's tokens so far: the window's slots hold its tokens 5 and 6
EXACT = 1e-6
BROKEN = 1e-2  # each break below misses AR's law by more than this on some case (measured worst: 0.065 - 0.18)


def table(rows) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.float64)
    return t / t.sum(-1, keepdim=True)


def flat_draws(shape, seed: int) -> torch.Tensor:
    """Dirichlet(1) rows: normalised exponentials."""
    e = -torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).log()
    return e / e.sum(-1, keepdim=True)


def sparse_rows() -> torch.Tensor:
    """p2(. | x1) on at most 4 tokens, each row on other ones (a top-p cut: zeros inside the width)."""
    return table([[0.6, 0.3, 0.1, 0, 0, 0], [0, 0.2, 0, 0.5, 0.3, 0], [0, 0, 0.1, 0.1, 0.4, 0.4],
                  [0.7, 0, 0, 0, 0, 0.3], [0.25, 0.25, 0, 0, 0.25, 0.25], [0, 0, 0, 1, 0, 0]])


def tied_rows() -> torch.Tensor:
    """p2(. | x1) uniform on x1 and the next two tokens."""
    return table([[1.0 if (y - x) % V < 3 else 0.0 for y in range(V)] for x in range(V)])


# name -> (p1 (V,), p2 (V, V): row x1 is p2(. | x1), q1 (V,), q2 (V,), the supports' width)
CASES = {
    "random": lambda: (flat_draws(V, 1), flat_draws((V, V), 2), flat_draws(V, 3), flat_draws(V, 4), V),
    # q's mass on tokens p cannot emit and p's on tokens q never drafts; the supports are top-4 of 6
    "supports apart": lambda: (table([0.5, 0.3, 0.2, 0, 0, 0]), sparse_rows(), table([0, 0, 0.1, 0.2, 0.4, 0.3]),
                               table([0.25, 0, 0, 0.05, 0.3, 0.4]), 4),
    # q1 near a point mass where p1 is flat; q2 the spatial prior's point mass (one candidate, the rest none)
    "q sharp": lambda: (table([0.2, 0.2, 0.15, 0.15, 0.15, 0.15]), flat_draws((V, V), 5),
                        table([0.01, 0.96, 0.01, 0.01, 0.01, 0]), table([0, 0, 0, 1, 0, 0]), V),
    # ties within p and within q, and q2 equal to one of p2's rows
    "ties": lambda: (table([1, 1, 1, 1, 0, 0]), tied_rows(), table([1, 1, 1, 1, 1, 0]), tied_rows()[4], 5),
}


def support(dense: torch.Tensor, width: int) -> Support:
    """(..., V) table -> its Support of `width` tokens in descending order (ties by token id); the tokens left out
    have probability 0."""
    probs, ids = torch.sort(dense, dim=-1, descending=True, stable=True)
    assert probs[..., width:].sum() == 0
    return Support(probs[..., :width].contiguous(), ids[..., :width].contiguous())


def ranked_tuples(q: torch.Tensor, k: int) -> list[tuple[tuple[int, ...], float]]:
    """Every ordered tuple the top k of log q + G can be (G i.i.d. Gumbel), which are k draws without replacement
    from q (Plackett-Luce), with its probability prod_r q(t_r) / (1 - q(t_0) - .. - q(t_{r-1})). A q on fewer
    than k tokens gives shorter tuples: the missing candidates are none."""
    tokens = [t for t in range(len(q)) if q[t] > 0]
    out = []
    for ranks in itertools.permutations(tokens, min(k, len(tokens))):
        prob, left = 1.0, 1.0
        for t in ranks:
            prob, left = prob * float(q[t]) / left, left - float(q[t])
        out.append((ranks, prob))
    return out


def tuples_table(q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ranked_tuples as tensors: the tuples (T, k), -1 past a shorter one's end, and their probabilities (T,)."""
    tuples = ranked_tuples(q, k)
    ranks = torch.tensor([list(t) + [-1] * (k - len(t)) for t, _ in tuples])
    return ranks, torch.tensor([p for _, p in tuples], dtype=torch.float64)


def tuple_index(drawn: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """drawn (B, k) tuples -> (B,) the row of `ranks` (T, k) each one is, -1 for none."""
    match = (drawn[:, None] == ranks[None]).all(-1)  # (B, T)
    return torch.where(match.any(-1), match.int().argmax(-1), -1)


class ChosenRanks:
    """Stands in for the coupled noise: at every window slot, noise that makes the top of log q + G a chosen
    tuple (its tokens lifted far above the rest, in order). Records the positions it is keyed by."""

    def __init__(self, ranks: torch.Tensor):
        self.ranks = ranks  # (B, L, K) tokens, -1: none
        self.positions = None

    def at(self, positions, ids, draws):
        self.positions = positions
        k = self.ranks.shape[-1]
        lift = torch.zeros(ids.shape, dtype=torch.float64)
        for r in range(k):
            lift += torch.where(ids == self.ranks[..., r:r + 1], 1000.0 * (k - r), 0.0)
        return lift


def window_proposal(k: int, b: int, draws) -> WindowProposal:
    """The engine's Jacobi proposer for mc-sjd-pac at window 2, branching k over both depths, b slots."""
    dcfg = method_preset("mc-sjd-pac", SamplingConfig(), window=2, branching=k, branch_depth=2)
    runner = SimpleNamespace(device="cpu", model_config=SimpleNamespace(vocab_size=V, grid_size=2))
    sampling = SlotSampling(dcfg.sampling, b, "cpu")
    return WindowProposal(runner, dcfg, acceptance_rule(dcfg, None, "cpu"), draws, sampling)


def proposed_tree(proposal: WindowProposal, q1: Support, q2: Support):
    """The window's q (both slots) set on every slot, its drafts drawn and the tree proposed."""
    b = proposal.sampling.temperature.shape[0]
    proposal.q = Support(*(torch.stack([a, c])[None].expand(b, -1, -1) for a, c in zip(q1, q2)))  # (B, 2, W)
    proposal.drafts, proposal.offered = proposal._drafts(proposal.q, torch.full((b,), EMITTED))
    slots = SimpleNamespace(root=torch.full((b,), EMITTED), root_tok=torch.full((b,), ROOT))
    return proposal.propose(slots)


def children_tokens(tree, parent_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, K) the tokens of the children of parents[row], and whether each is a candidate."""
    kids = tree.children.expand(1, -1, -1)[0, parent_row]  # children (B|1, M, C), or (M, C) shared
    return tree.tokens[:, kids], tree.valid[:, kids]


def first_taken(acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., C) acceptance probabilities in rank order -> P(child j is the one taken) (..., C):
    prod_{i<j} (1 - acc_i) acc_j, and P(every child rejected) (...)."""
    rejected = torch.cumprod(1.0 - acc, -1)
    before = torch.cat([torch.ones_like(acc[..., :1]), rejected[..., :-1]], -1)
    return before * acc, rejected[..., -1]


def step_law(case: str, k: int, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the enumerated law of the first two committed tokens (V, V), AR's p1(x1) p2(x2 | x1) (V, V))."""
    p1, p2, q1, q2, width = CASES[case]()
    (ranks1, weight1), (ranks2, weight2) = (tuples_table(q, k) for q in (q1, q2))
    assert abs(weight1.sum() - 1) < 1e-12 and abs(weight2.sum() - 1) < 1e-12
    # every pair (t1, t2), row b = i * len(t2s) + j, and its probability P(t1) P(t2) (B,)
    n1, n2 = len(weight1), len(weight2)
    ranks = torch.stack([ranks1.repeat_interleave(n2, 0), ranks2.repeat(n1, 1)], 1)  # (B, 2, K)
    weight = (weight1[:, None] * weight2[None]).flatten()
    b = len(weight)

    proposal = window_proposal(k, b, torch.Generator().manual_seed(0))
    proposal.noise = ChosenRanks(ranks)
    tree = proposed_tree(proposal, support(q1, width), support(q2, width))
    # each slot's noise is keyed by its own token's index in the image
    assert torch.equal(proposal.noise.positions, torch.tensor([EMITTED, EMITTED + 1]).expand(b, -1))
    parents = tree.parents[0].tolist()
    assert parents[0] == 0 and len(parents) == 1 + k  # the root, then the k nodes at depth 1
    for row, rank in zip(range(1 + k), [0] + [1] * k):  # the root's children: t1; every depth-1 node's: t2
        tokens, valid = children_tokens(tree, row)
        assert torch.equal(valid, ranks[:, rank] >= 0)
        assert torch.equal(torch.where(valid, tokens, -1), ranks[:, rank])

    # the target at every node: p1 at the root, p2(. | x) at a depth-1 node x, p1 again at the leaves (whose
    # bonus is the third token, not enumerated)
    p1_sup, p2_sup = support(p1, width), support(p2, width)
    at_depth1 = (tree.depth[0] == 1)[None, :, None]
    p_nodes = Support(torch.where(at_depth1, p2_sup.probs[tree.tokens], p1_sup.probs),
                      torch.where(at_depth1, p2_sup.ids[tree.tokens], p1_sup.ids))
    seen = {}
    with monkeypatch.context() as m:  # read the acceptance probabilities and the residuals the step uses
        real = acceptance._rule

        def rule_seen(p, cand, *rest):
            out = real(p, cand, *rest)
            seen["cand"], seen["acc"], seen["last"] = cand, out[0], out[1]
            return out
        m.setattr(acceptance, "_rule", rule_seen)
        proposal.accept(p_nodes, tree)
    cand, acc, last = seen["cand"], seen["acc"], seen["last"]

    def bonus(row: int) -> torch.Tensor:
        """(B, V) the distribution a bonus is drawn from after every child of parents[row] was rejected."""
        return last.rejected(torch.full((b, 1), row)).dense(V)[:, 0]

    joint = torch.zeros(b, V, V, dtype=torch.float64)
    take, none = first_taken(acc[:, 0])  # the root's children
    joint += none[:, None, None] * bonus(0)[:, :, None] * p2[None]  # x1 a bonus, then AR's step
    for j, node in enumerate(tree.children.expand(1, -1, -1)[0, 0].tolist()):
        row = parents.index(node)
        x1 = tree.tokens[:, node]
        take2, none2 = first_taken(acc[:, row])
        second = torch.zeros(b, V, dtype=torch.float64).scatter_add_(1, cand[:, row], take2)
        second += none2[:, None] * bonus(row)
        joint[torch.arange(b), x1] += take[:, j, None] * second
    law = (weight[:, None, None] * joint).sum(0)
    return law, p1[:, None] * p2


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_the_first_two_tokens_of_a_branching_window_step_are_ars_exactly(case, k, monkeypatch):
    law, ar = step_law(case, k, monkeypatch)
    assert (law - ar).abs().max() < EXACT, (law - ar).abs().max()


real_rejection = acceptance._recursive_rejection


def no_residual(target, cand, cvalid, q_at, q_sup, vocab, rows_at_rank=None):
    """Broken: a rejection leaves the target as it was (every sibling tested against p, the bonus drawn from p)."""
    _, left = real_rejection(target, cand, cvalid, q_at, q_sup, vocab, rows_at_rank)
    q_x = q_at.prob(cand)
    q_i = q_x / (1.0 - acceptance.earlier_mass(q_x, cvalid)).clamp_min(1e-12)
    acc = (target.lookup(vocab).prob(cand) / q_i.clamp_min(1e-30)).clamp(max=1.0) * cvalid
    return acc, left._replace(level=torch.zeros_like(left.level), drafted=torch.zeros_like(left.drafted))


def residual_against_q(q_x, valid):
    """Broken: every candidate is tested and subtracted as if drawn from q itself (with replacement)."""
    return torch.zeros_like(q_x)


real_propose = WindowProposal.propose


def children_of_slot0(self, slots):
    """Broken: every parent's children are tested as drawn from window slot 0's q (depth 2's from q1, not q2)."""
    tree = real_propose(self, slots)
    first = tree.q.index(torch.zeros_like(tree.q.ids[..., 0]))
    return replace(tree, q=first)


BREAKS = {"no residual": (acceptance, "_recursive_rejection", no_residual),
          "residual against q": (acceptance, "earlier_mass", residual_against_q),
          "depth 2 against q1": (WindowProposal, "propose", children_of_slot0)}


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("broken", list(BREAKS))
def test_a_broken_step_fails_the_exact_law(broken, k, monkeypatch):
    """The same enumeration with the step broken in the library: AR's law missed by more than BROKEN on some
    case (a break may leave a case exact: against q is against q_i when every candidate passes)."""
    monkeypatch.setattr(*BREAKS[broken])
    worst = max((law - ar).abs().max() for law, ar in (step_law(c, k, monkeypatch) for c in CASES))
    assert worst > BROKEN, worst


def test_every_parent_at_a_depth_reads_the_same_plackett_luce_drafts_of_its_position():
    """On the real coupled noise (one seed per image): the candidates under the root and under every depth-1 node
    are each slot's ranked drafts, the same under every parent, and the pair of tuples (t1, t2) is distributed as
    two independent Plackett-Luce draws (chi-square over all ordered pairs)."""
    b, k = 30000, 2
    draws = SlotDraws(b, "cpu")
    draws.admit(torch.arange(b), torch.arange(b) * 7919 + 11)
    draws.begin()
    q1, q2 = table([0.35, 0.25, 0.2, 0.1, 0.1, 0]), table([0.05, 0.1, 0.15, 0.2, 0.2, 0.3])
    tree = proposed_tree(window_proposal(k, b, draws), support(q1, V), support(q2, V))
    first, _ = children_tokens(tree, 0)
    second = [children_tokens(tree, row)[0] for row in range(1, 1 + k)]
    assert all(torch.equal(s, second[0]) for s in second)
    (ranks1, weight1), (ranks2, weight2) = (tuples_table(q, k) for q in (q1, q2))
    which1, which2 = tuple_index(first, ranks1), tuple_index(second[0], ranks2)
    assert min(which1.min(), which2.min()) >= 0  # no token off q's support, no repeat within a tuple
    counts = torch.bincount(which1 * len(ranks2) + which2, minlength=len(ranks1) * len(ranks2)).double()
    assert pvalue(counts, (weight1[:, None] * weight2[None]).flatten()) > LEVEL
