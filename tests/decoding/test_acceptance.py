"""Acceptance as a tensor program: the exact rule is lossless, the bounded relaxation outputs exactly its p_hat
(within the recorded TV of p), the paper form is LANTERN's own rule (test_paper_rule_parity.py), p(x) = 0 is never
accepted but by LANTERN's own (k, delta) rule.

Every statistical test runs many one-node trees as one batch: row b is an independent trial."""
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

import lantern.decoding.acceptance as acc
from lantern.decoding.acceptance import Acceptance
from node_trials import full_support, one_node_trials
import lantern.decoding.relaxation as relaxation
from lantern.decoding.relaxation import bounded_target
from lantern.decoding.sampling import Support, draw

SIGNIFICANCE = 1e-3  # a lossless rule fails a test at this level once in a thousand seeds


one_node = one_node_trials  # (p, q, n_children, rule, trials, seed, deterministic, greedy) -> (first, out)


def counts_of(tokens: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=v).float()


def matches(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of counts against probs (outcomes with zero probability must have no counts)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0
    return chisquare(counts[keep], probs[keep] / probs[keep].sum() * counts.sum()).pvalue


P = torch.tensor([0.30, 0.05, 0.25, 0.02, 0.18, 0.20])
Q = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.05, 0.15])


@pytest.mark.parametrize("deterministic", [False, True])
def test_exact_multi_candidate_rule_reproduces_p(deterministic):
    first, _ = one_node(P, Q, 3, Acceptance("exact"), trials=20000, seed=1, deterministic=deterministic)
    assert matches(counts_of(first, 6), P) > SIGNIFICANCE


def test_a_residual_against_q_instead_of_q_i_fails_the_same_test(monkeypatch):
    """Testing and subtracting q itself (not q with the earlier candidates removed) on each rejection is biased."""
    monkeypatch.setattr(acc, "earlier_mass", lambda q_x, valid: torch.zeros_like(q_x))
    first, _ = one_node(P, Q, 3, Acceptance("exact"), trials=20000, seed=0)
    assert matches(counts_of(first, 6), P) < SIGNIFICANCE


def reference_recursive_rejection(r, q, cand, valid):
    """The exact rule candidate by candidate on dense float64 vectors (V,): candidate j is tested against the
    residual r_j with q_j = q without the earlier candidates, renormalised; a rejection leaves normalise((r_j -
    q_j)+), or r_j where nothing is left. Returns each candidate's acceptance probability and the last residual."""
    r, q, removed, acc_probs = r.double(), q.double(), torch.zeros_like(q, dtype=torch.bool), []
    for x, v in zip(cand.tolist(), valid.tolist()):
        q_j = q.masked_fill(removed, 0.0)
        q_j = q_j / q_j.sum().clamp_min(1e-300)
        acc_probs.append(min(1.0, float(r[x] / q_j[x])) if v and q_j[x] > 0 else 0.0)
        if v:
            left = (r - q_j).clamp_min(0.0)
            r = left / left.sum() if left.sum() > 0 else r
            removed[x] = True
    return torch.tensor(acc_probs, dtype=torch.float64), r


@pytest.mark.parametrize("support", [5, 40, 64])
@pytest.mark.parametrize("tree_rows", [False, True])
def test_the_closed_form_is_the_rule_candidate_by_candidate(support, tree_rows):
    """Acceptance probabilities and the residual a bonus is drawn from, at every parent, equal the rule applied one
    candidate at a time: candidates past the target's support, padding, a draft distribution wider than the
    target's, a parent whose first candidate takes all (nothing left after it) and one with no candidate. With
    `tree_rows`, later parents have fewer children, as in a tree, and each rank reads only the rows that have
    a candidate there (rows_at_rank)."""
    v, c = 64, 12
    torch.manual_seed(support)
    r_dense = torch.distributions.Dirichlet(torch.full((v,), 0.3)).sample((2, 6))
    ids = r_dense.argsort(-1, descending=True)[..., :support]
    r = Support(r_dense.gather(-1, ids) / r_dense.gather(-1, ids).sum(-1, keepdim=True), ids)
    q_dense = torch.distributions.Dirichlet(torch.full((v,), 0.3)).sample((2, 6))
    q_dense[0, 1] = r.dense(v)[0, 1]  # the first candidate is always accepted: the residual after it is empty
    cand = (q_dense.log() + torch.distributions.Gumbel(0.0, 1.0).sample((2, 6, v))).topk(c, -1).indices
    valid = torch.ones(2, 6, c, dtype=torch.bool)
    valid[1, 2, 7:] = False  # padding
    valid[0, 3] = False  # no candidate
    rows_at_rank = None
    if tree_rows:  # 12 children at row 0, 4 at rows 1-2, 1 at rows 3-5
        valid[:, 1:3, 4:], valid[:, 3:, 1:] = False, False
        rows_at_rank = (6, 3, 3, 3) + (1,) * (c - 4)
    q_ids = q_dense.argsort(-1, descending=True)
    q = Support(q_dense.gather(-1, q_ids), q_ids)
    q_at = q.lookup(v)
    got, left = acc._recursive_rejection(r, cand, valid, q_at, q_at.prob(r.ids), v, rows_at_rank)
    rejected = torch.stack([left.rejected(torch.full((2, 1), m)).dense(v)[:, 0] for m in range(6)], 1)
    for b in range(2):
        for m in range(6):
            want, residual = reference_recursive_rejection(r.dense(v)[b, m], q_dense[b, m], cand[b, m], valid[b, m])
            assert torch.allclose(got[b, m].double(), want, atol=1e-5), (b, m)
            assert torch.allclose(rejected[b, m].double(), residual, atol=1e-5), (b, m)
    assert float(got[0, 1, 0]) == pytest.approx(1.0, abs=1e-6) and got[0, 3].eq(0).all()


def codebook_rule(kind, v=64, form="bounded", **kw):
    """A proximity table of random 4-D codes (neighbours by distance, self excluded)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randn(v, 4, generator=g)
    d = torch.cdist(codes, codes)
    prox = torch.argsort(d, dim=1)[:, 1:]
    return Acceptance(kind, proximity=prox, form=form, **kw)


def flat_pair(v=64, seed=3, alpha=0.3):
    """A flat target p and a different draft q (Dirichlet(alpha)), like image-token distributions."""
    d = torch.distributions.Gamma(torch.full((2, v), alpha), torch.ones(2, v))
    torch.manual_seed(seed)
    pq = d.sample()
    pq = pq / pq.sum(-1, keepdim=True)
    return pq[0], pq[1]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("rule", [codebook_rule("lantern", k=8, delta=0.1),
                                  codebook_rule("lantern++", k=8, lam=2.0)], ids=["lantern", "lantern++"])
def test_bounded_relaxation_outputs_exactly_p_hat_and_not_p(rule, deterministic):
    p, q = flat_pair()
    first, out = one_node(p, q, 3, rule, trials=30000, seed=1, deterministic=deterministic)
    if deterministic:  # the candidate set is the same every trial: the top 3 of q
        q_sup = torch.zeros(64).scatter_(0, torch.topk(q, 3).indices, 1.0)
    else:
        q_sup = q
    p_hat, tv = bounded_target(full_support(p[None, None]), q_sup[None, None], rule.links("cpu"), 64,
                               *rule.bounds)
    p_hat, tv = p_hat[0, 0], float(tv[0, 0])
    counts = counts_of(first, 64)
    assert matches(counts, p_hat) > SIGNIFICANCE
    assert tv > 0.02 and matches(counts, p) < SIGNIFICANCE  # it really is p_hat, not p
    assert float((p_hat - p).abs().sum() / 2) == pytest.approx(tv, abs=1e-5)  # recorded TV is the true TV
    if rule.kind == "lantern":
        assert tv <= rule.delta + 1e-6
    else:
        assert torch.all(p_hat - p <= (rule.lam - 1) * p + 1e-6)  # at most (lam - 1) p(y) into each token y
    assert torch.allclose(out.token_tv[:, 0], torch.full((30000,), tv))  # recorded per token


def top_k_pair():
    """A target with zeros (top-k removed half the vocabulary) and a draft that likes those tokens."""
    p, q = flat_pair(seed=5)
    p = torch.where(torch.arange(64) % 2 == 0, p, 0.0)
    q = torch.where(torch.arange(64) % 2 == 1, q * 4, q)
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("rule", [
    Acceptance("exact"), codebook_rule("lantern", k=16, delta=0.3), codebook_rule("lantern++", k=16, lam=4.0),
    codebook_rule("lantern++", form="paper", k=16, lam=4.0)],
    ids=["exact", "bounded-lantern", "bounded-lantern++", "paper-lantern++"])
def test_no_rule_but_lanterns_own_ever_emits_a_token_the_target_cannot(rule, greedy):
    """LANTERN++'s bound (lam - 1) p(x) gives a token with p(x) = 0 nothing, in either form."""
    p, q = top_k_pair()
    first, out = one_node(p, q, 4, rule, trials=4000, seed=2, greedy=greedy)
    assert torch.all(p[first] > 0)  # accepted drafts and residual draws alike (leaves' bonuses follow their own p)


@pytest.mark.parametrize("greedy", [False, True])
def test_the_paper_form_boosts_a_token_the_target_cannot_emit_as_lantern_does(greedy):
    """LANTERN's (k, delta) rule tests a candidate x with p(x) = 0 (outside the target's top-k) against its
    neighbours' mass C_m*(x) like any other: accepted with probability C_m*(x) (greedy: when that reaches the
    best token's probability)."""
    prox = torch.tensor([[1, 2], [0, 2], [0, 1]])
    p = torch.tensor([0.0, 0.3, 0.7]) if not greedy else torch.tensor([0.0, 0.55, 0.45])
    q = torch.tensor([1.0, 0.0, 0.0])  # the draft's top-1 is token 0
    rule = Acceptance("lantern", k=1, delta=0.6, proximity=prox, form="paper")  # C_1(0) = p(1)
    first, out = one_node(p, q, 1, rule, trials=4000, seed=3, deterministic=True, greedy=greedy)
    taken = (out.accepted > 0).float()
    if greedy:
        assert bool(taken.all()) and torch.all(first == 0)  # 0 + 0.55 >= 0.45
    else:
        assert float(taken.mean()) == pytest.approx(0.3, abs=0.03) and torch.all(first[out.accepted > 0] == 0)
    assert torch.allclose(out.boost[out.accepted > 0, 0], torch.tensor(p[1].item()))


@pytest.mark.parametrize("kw", [dict(kind="lantern", k=10, delta=0.0), dict(kind="lantern", k=0, delta=0.3),
                                dict(kind="lantern++", k=10, lam=1.0)])
@pytest.mark.parametrize("form", ["bounded", "paper"])
def test_zero_relaxation_is_the_exact_rule_draw_for_draw(kw, form):
    rule = codebook_rule(form=form, **kw)
    assert not rule.relaxed
    exact, _ = one_node(P, Q, 3, Acceptance("exact"), trials=500, seed=5)
    relaxed, _ = one_node(P, Q, 3, rule, trials=500, seed=5)
    assert torch.equal(exact, relaxed)


@pytest.mark.parametrize("form", ["bounded", "paper"])
def test_relaxation_accepts_more_than_exact(form):
    p, q = flat_pair()
    rule = codebook_rule("lantern", form=form, k=8, delta=0.2)
    _, exact = one_node(p, q, 1, Acceptance("exact"), trials=4000, seed=4)
    _, relaxed = one_node(p, q, 1, rule, trials=4000, seed=4)
    assert relaxed.accepted.float().mean() > exact.accepted.float().mean() + 0.05


def reference_bounded_target(p: torch.Tensor, q: torch.Tensor, neighbours: torch.Tensor, delta, lam):
    """The bounded target written out densely for one node, (V,) each: flow[y, z] from source z to receiver y
    over the V x V neighbour matrix, as docs/algorithms.md section 5 states it."""
    v = p.shape[0]
    link = torch.zeros(v, v, dtype=torch.float64).scatter_(1, neighbours.long(), 1.0)  # y -> z among y's k
    p, q = p.double(), q.double()
    excess = (p - q).clamp_min(0)
    want = (q - p).clamp_min(0) * (p > 0)
    if lam is not None:
        want = torch.minimum(want, (lam - 1) * p)
    avail = link * excess[None, :]
    total = avail.sum(1)
    share = torch.where(total[:, None] > 0, avail / total.clamp_min(1e-300)[:, None], 0)
    flow = torch.minimum(want, total)[:, None] * share
    demand = flow.sum(0)
    flow = flow * torch.where(demand > excess, excess / demand.clamp_min(1e-300), 1.0)[None, :]
    if delta is not None and flow.sum() > delta:
        flow = flow * delta / flow.sum()
    return p + flow.sum(1) - flow.sum(0), float(flow.sum())


@pytest.fixture(params=["receivers", "codebook"])
def walk(request, monkeypatch):
    """The bounded target's lists walked over the receivers, or over the codebook, whatever the shapes."""
    monkeypatch.setattr(relaxation, "walks_the_codebook", lambda *shape: request.param == "codebook")
    return request.param


@pytest.mark.parametrize("kw", [dict(kind="lantern", delta=0.3), dict(kind="lantern++", lam=3.0)])
@pytest.mark.parametrize("k", [3, 8, 63])
@pytest.mark.parametrize("support", [5, 40])
def test_bounded_target_matches_the_dense_reference_in_any_blocking(kw, k, support, walk, monkeypatch):
    """Either walk over the neighbour lists, read in blocks (as at LlamaGen's sizes), gives every node the dense
    V x V reference's p_hat and moved mass, whether a block holds every row and neighbour or one neighbour of
    one row."""
    rule = codebook_rule(v=64, k=k, **kw)
    torch.manual_seed(7)
    ids = torch.rand(3, 9, 64).argsort(-1)[..., :support]  # (B, M, K) distinct tokens per node
    probs = torch.distributions.Dirichlet(torch.full((support,), 0.5)).sample((3, 9))
    probs[0, 0, 4] = 0.0  # a token the target cannot emit never receives
    q_sup = torch.distributions.Dirichlet(torch.full((support,), 0.5)).sample((3, 9)) * 0.9
    p = Support(probs, ids)
    whole = bounded_target(p, q_sup, rule.links("cpu"), 64, *rule.bounds)
    monkeypatch.setattr(relaxation, "WORKSPACE_BYTES", 1)  # one row, one neighbour at a time
    blocked = bounded_target(p, q_sup, rule.links("cpu"), 64, *rule.bounds)
    assert float(whole[1].max()) > 0.05  # mass really moved
    for a, b in zip(whole, blocked):
        assert torch.allclose(a, b, atol=1e-6)
    for b_, m_ in [(0, 0), (1, 4), (2, 8)]:
        dense_p = Support(probs, ids).dense(64)[b_, m_]
        dense_q = torch.zeros(64).scatter_(0, ids[b_, m_], q_sup[b_, m_])
        want_hat, want_moved = reference_bounded_target(dense_p, dense_q, rule.neighbours("cpu"), *rule.bounds)
        got_hat = Support(whole[0], ids).dense(64)[b_, m_]
        assert torch.allclose(got_hat.double(), want_hat, atol=1e-5)
        assert float(whole[1][b_, m_]) == pytest.approx(want_moved, abs=1e-5)


def test_receivers_restricted_to_the_candidates_give_the_same_target(walk):
    """Deterministic drafts: only candidates can receive; naming them as receivers (duplicates and slots that
    receive nothing included) gives the target of the whole support, on either walk."""
    rule = codebook_rule("lantern", v=64, k=8, delta=0.4)
    torch.manual_seed(3)
    ids = torch.rand(2, 5, 64).argsort(-1)[..., :30]
    probs = torch.distributions.Dirichlet(torch.full((30,), 0.5)).sample((2, 5))
    slots = torch.randint(0, 30, (2, 5, 4))
    slots[:, :, 3] = slots[:, :, 0]  # a candidate named twice receives once
    q_sup = torch.zeros(2, 5, 30).scatter_(2, slots, 1.0)
    p = Support(probs, ids)
    whole = bounded_target(p, q_sup, rule.links("cpu"), 64, *rule.bounds)
    named = bounded_target(p, q_sup, rule.links("cpu"), 64, *rule.bounds, receivers=slots)
    assert float(whole[1].max()) > 0.05
    for a, b in zip(whole, named):
        assert torch.allclose(a, b, atol=1e-6)


def test_paper_boost_is_the_neighbours_mass_within_the_bound():
    rule = codebook_rule("lantern", form="paper", k=10, delta=0.1)
    p, q = flat_pair()
    _, out = one_node(p, q, 3, rule, trials=2000, seed=6)
    boosts = out.boost[out.accepted > 0, 0]
    assert boosts.max() <= 0.1 + 1e-6 and boosts.max() > 0


@pytest.mark.parametrize("kw, message", [
    (dict(kind="lantern", k=5, delta=1.5), r"delta 1.5 is outside \[0, 1\]"),
    (dict(kind="lantern", k=5, delta=-0.1), r"delta -0.1 is outside \[0, 1\]"),
    (dict(kind="lantern", k=5, delta=float("nan")), r"delta nan is outside \[0, 1\]"),
    (dict(kind="lantern++", k=5, lam=0.5), "lambda 0.5 must be a finite number >= 1"),
    (dict(kind="lantern++", k=5, lam=float("inf")), "lambda inf must be a finite number >= 1"),
    (dict(kind="typical", k=5), "unknown acceptance 'typical'"),
    (dict(kind="lantern", k=5, delta=0.1, form="loose"), "unknown relaxation form 'loose'"),
    (dict(kind="lantern", k=5, delta=0.1, proximity=None), "needs a proximity table"),
    (dict(kind="lantern", k=7, delta=0.1, proximity=torch.zeros(4, 3, dtype=torch.long)),
     r"k 7 exceeds the proximity table's 3 neighbours; allowed: 0..3"),
])
def test_bad_parameters_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        Acceptance(**kw)


def test_greedy_paper_rule_accepts_a_near_tie_only_within_the_bound():
    prox = torch.tensor([[1, 2], [0, 2], [0, 1]])
    p = torch.tensor([0.45, 0.40, 0.15])
    q = torch.tensor([0.0, 1.0, 0.0])  # the draft's top-1 is token 1

    def first(rule):
        return one_node(p, q, 1, rule, trials=1, seed=0, greedy=True)

    exact_tok, exact = first(Acceptance("exact"))
    loose_tok, loose = first(Acceptance("lantern", k=1, delta=0.5, proximity=prox, form="paper"))
    _, tight = first(Acceptance("lantern", k=1, delta=0.1, proximity=prox, form="paper"))
    assert int(exact.accepted) == 0 and int(exact_tok) == 0  # token 1 is not the argmax
    assert int(loose.accepted) == 1 and float(loose.boost[0, 0]) == pytest.approx(0.45)  # 0.40 + 0.45 >= 0.45
    assert int(tight.accepted) == 0  # neighbour 0 holds 0.45 > delta, so nothing moves


def random_chain(b=6, window=7, v=64, k=5, seed=0):
    """B Jacobi-like chains [root; d_1 .. d_L]: p after every node and q for every draft on top-k supports
    (near p but for image 0), drafts drawn from q, and limits that cut some chains short (one image finished:
    nothing valid)."""
    g = torch.Generator().manual_seed(seed)

    def support(*shape):
        vals, ids = torch.topk(torch.randn(*shape, v, generator=g) * 2, k, dim=-1)
        return Support(torch.softmax(vals, -1), ids)
    p_nodes = support(b, window + 1)
    # q near p on p's support (a converging window), unrelated for image 0
    near = torch.softmax(p_nodes.probs[:, :window].log() + 0.3 * torch.randn(b, window, k, generator=g), -1)
    q = Support(near, p_nodes.ids[:, :window])
    other = support(1, window)
    q = Support(torch.cat([other.probs, q.probs[1:]]), torch.cat([other.ids, q.ids[1:]]))
    drafts = draw(q, False, g)  # (B, L)
    tokens = torch.cat([torch.randint(0, v, (b, 1), generator=g), drafts], 1)
    limit = torch.tensor([window, window, 3, 0, -1, window][:b])
    valid = torch.arange(window + 1)[None] <= limit[:, None]
    return p_nodes, q, tokens, valid


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("rule", [Acceptance("exact"), codebook_rule("lantern", k=8, delta=0.2),
                                  codebook_rule("lantern++", k=8, lam=2.0),
                                  codebook_rule("lantern", k=8, delta=0.1, form="paper")])
def test_chain_acceptance_is_the_tree_acceptance_on_a_chain(rule, greedy):
    """A tree marked as a chain skips the walk over its structure; it must give the walk's result draw for draw."""
    from lantern.decoding.acceptance import DraftedTree, accept
    for seed in range(5):
        p_nodes, q, tokens, valid = random_chain(seed=seed)
        n = tokens.shape[1]
        nodes = torch.arange(n)
        tree = DraftedTree(tokens=tokens, valid=valid, depth=nodes[None],
                           ancestors=torch.ones(n, n, dtype=torch.bool).tril()[None], parents=nodes[None, :-1],
                           children=nodes[None, 1:, None], q=None if greedy else q, max_depth=n - 1,
                           rank=torch.zeros(1, n, dtype=torch.long))
        want = accept(p_nodes, tree, rule, greedy, torch.Generator().manual_seed(seed), 64)
        got = accept(p_nodes, replace(tree, chain=True), rule, greedy, torch.Generator().manual_seed(seed), 64)
        for field in ("path", "accepted", "bonus", "tried", "token_tv", "boost"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (field, seed)
        if not greedy:
            assert want.accepted.max() >= 3  # long prefixes were accepted too
