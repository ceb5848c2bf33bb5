"""Acceptance rules: the exact rule is lossless (statistically), relaxations stay within their bounds."""
import pytest
import torch
from scipy.stats import chisquare

import lantern.decoding.acceptance as acc
from lantern.decoding.acceptance import Acceptance, walk_tree

SIGNIFICANCE = 1e-3  # a lossless rule fails a test at this level once in a thousand seeds


def one_node_walk(p, q, n_children, rule, trials, seed, deterministic=False):
    """Root with n children drawn from q without replacement (or top-n, deterministic); each child a leaf
    whose target distribution is irrelevant, since we record only the first output token."""
    g = torch.Generator().manual_seed(seed)
    v = p.shape[0]
    children = [tuple(range(1, n_children + 1))] + [()] * n_children
    p_nodes = torch.cat([p[None], torch.full((n_children, v), 1.0 / v)])
    counts = torch.zeros(v)
    for _ in range(trials):
        cand = torch.topk(q, n_children).indices if deterministic else torch.multinomial(q, n_children, generator=g)
        tokens = torch.cat([torch.tensor([0]), cand])
        q_nodes = None if deterministic else torch.cat([q[None], torch.zeros(n_children, v)])
        w = walk_tree(p_nodes, children, tokens, torch.ones(n_children + 1, dtype=torch.bool), q_nodes, rule,
                      greedy=False, generator=g, max_accept=1)
        first = int(tokens[w.path[1]]) if len(w.path) > 1 else w.bonus
        counts[first] += 1
    return counts


P = torch.tensor([0.30, 0.05, 0.25, 0.02, 0.18, 0.20])
Q = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.05, 0.15])


@pytest.mark.parametrize("deterministic", [False, True])
def test_exact_multi_candidate_rule_reproduces_p(deterministic):
    counts = one_node_walk(P, Q, 3, Acceptance("exact"), trials=20000, seed=0, deterministic=deterministic)
    assert chisquare(counts, P * counts.sum()).pvalue > SIGNIFICANCE


def test_a_broken_rule_fails_the_same_test(monkeypatch):
    """Subtracting the distribution with x_i already removed (the reference code's static-tree bug)."""
    def broken(p, kids, tok, q, rule, generator):
        residual, remaining = p.clone(), q.clone()
        for c in kids:
            x = tok[c]
            q_i = remaining / remaining.sum()
            if float(torch.rand((), generator=generator)) * float(q_i[x]) < float(residual[x]):
                return c, residual, 0.0
            remaining[x] = 0.0
            nxt = (residual - remaining / remaining.sum()).clamp_min(0)  # wrong: x_i's own draw distribution
            residual = nxt / nxt.sum() if nxt.sum() > 0 else residual
        return None, residual, 0.0
    monkeypatch.setattr(acc, "_choose_sampling", broken)
    counts = one_node_walk(P, Q, 3, Acceptance("exact"), trials=20000, seed=0)
    assert chisquare(counts, P * counts.sum()).pvalue < SIGNIFICANCE


def relaxed(kind, **kw):
    torch.manual_seed(0)
    prox = torch.stack([torch.randperm(64) for _ in range(64)])
    prox = torch.stack([row[row != i][:63] for i, row in enumerate(prox)])
    return Acceptance(kind, proximity=prox, **kw)


@pytest.mark.parametrize("rule", [relaxed("lantern", k=10, delta=0.1), relaxed("lantern", k=63, delta=0.4),
                                  relaxed("lantern++", k=10, lam=3.0), relaxed("lantern++", k=63, lam=1.5)])
def test_moved_mass_is_within_the_bound(rule):
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        p = torch.softmax(torch.randn(64, generator=g) * 2, 0)
        x = int(torch.randint(0, 64, (), generator=g))
        p_tilde, moved = rule.boost(p, x)
        bound = rule.delta if rule.kind == "lantern" else (rule.lam - 1) * float(p[x])
        assert 0.0 <= moved <= bound + 1e-12
        assert p_tilde == pytest.approx(float(p[x]) + moved)
        # the moved mass is exactly the latent neighbours' mass, taken greedily in proximity order
        m = sum(1 for c in p[rule.proximity[x, :rule.k]].double().cumsum(0) if c <= bound)
        assert moved == pytest.approx(float(p[rule.proximity[x, :m]].sum()))


@pytest.mark.parametrize("kw", [dict(kind="lantern", k=10, delta=0.0), dict(kind="lantern", k=0, delta=0.3),
                                dict(kind="lantern++", k=10, lam=1.0)])
def test_zero_relaxation_is_the_exact_rule(kw):
    rule = relaxed(**kw)
    assert not rule.relaxed
    counts_relaxed = one_node_walk(P, Q, 3, Acceptance("exact"), trials=500, seed=5)
    counts_exact = one_node_walk(P, Q, 3, rule, trials=500, seed=5)
    assert torch.equal(counts_relaxed, counts_exact)


@pytest.mark.parametrize("kw, message", [
    (dict(kind="lantern", k=5, delta=1.5), r"delta 1.5 is outside \[0, 1\]"),
    (dict(kind="lantern", k=5, delta=-0.1), r"delta -0.1 is outside \[0, 1\]"),
    (dict(kind="lantern++", k=5, lam=0.5), "lambda 0.5 must be >= 1"),
    (dict(kind="typical", k=5), "unknown acceptance 'typical'"),
    (dict(kind="lantern", k=5, delta=0.1, proximity=None), "needs a proximity table"),
])
def test_bad_parameters_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        Acceptance(**kw)


def test_greedy_relaxation_accepts_a_near_tie_only_within_the_bound():
    prox = torch.tensor([[1, 2], [0, 2], [0, 1]])
    p = torch.tensor([0.45, 0.40, 0.15])
    children, tokens, valid = [(1,), ()], torch.tensor([0, 1]), torch.ones(2, dtype=torch.bool)
    p_nodes = torch.stack([p, p])
    g = torch.Generator()
    exact = walk_tree(p_nodes, children, tokens, valid, None, Acceptance("exact"), True, g, 1)
    loose = walk_tree(p_nodes, children, tokens, valid, None, Acceptance("lantern", k=1, delta=0.5, proximity=prox),
                      True, g, 1)
    tight = walk_tree(p_nodes, children, tokens, valid, None, Acceptance("lantern", k=1, delta=0.1, proximity=prox),
                      True, g, 1)
    assert exact.path == [0] and exact.bonus == 0  # token 1 is not the argmax
    assert loose.path == [0, 1] and loose.moved == [pytest.approx(0.45)]  # 0.40 + 0.45 >= 0.45
    assert tight.path == [0]  # neighbour 0 holds 0.45 > delta, so nothing moves
