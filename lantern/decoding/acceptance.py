"""Acceptance as one tensor program on the runner's device: which drafted nodes a target keeps, per image.

For a drafted tree and the target's distribution p at every node, nothing in the rule depends on the random
draws except which branch is taken, so every candidate's acceptance probability (and the residual each later
sibling is tested against) is computed up front, batched over images and nodes (a loop over sibling rank
only; for sampled drafts under the exact rule a rank is one pass over the support: `_recursive_rejection`).
Then one uniform per candidate decides: a child is taken iff its uniform is below its acceptance
probability and every earlier valid sibling was rejected; a node is on the accepted path iff it and all its
ancestors were taken (on a chain, [root; d_1 .. d_L] such as a Jacobi window: the prefix up to the first
rejection). The bonus token is one draw from the residual at the last accepted node, computed there only (or
from p there when no child was tried). Only the path (B, depth + 1), its length and the bonus token are results.

Rules (docs/algorithms.md):
- exact: recursive rejection against q_i, the distribution candidate i was drawn from (q without the
  earlier candidates, renormalised), residual normalise(max(r - q_i, 0)); lossless. Greedy: the argmax.
- lantern (k, delta) / lantern++ (k, lam), form "bounded" (default): the exact rule against a fixed relaxed
  target p_hat (lantern.decoding.relaxation); form "paper": LANTERN's own rule, as jadohu/LANTERN's code runs it:
  the per-candidate boost (relaxation.paper_test), and after a rejection x's k + 1 nearest codes cleared from the
  residual (deterministic drafts, its `evaluate_posterior`) or from q_i before it is subtracted (sampled drafts,
  `evaluate_posterior_v1`); a residual left empty becomes uniform.
delta = 0, lam = 1 or k = 0 is the exact rule, draw for draw.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from lantern.decoding.relaxation import NeighbourLinks, bounded_target, paper_test
from lantern.decoding.sampling import Draws, Support, SupportLookup, draw, uniform

KINDS = ("exact", "lantern", "lantern++")
FORMS = ("bounded", "paper")


def check_rule(kind: str, k: int, delta: float, lam: float, form: str = "bounded") -> None:
    """Refuse bad acceptance parameters, naming the value and what is allowed."""
    if kind not in KINDS:
        raise ValueError(f"unknown acceptance {kind!r}; allowed: {', '.join(KINDS)}")
    if form not in FORMS:
        raise ValueError(f"unknown relaxation form {form!r}; allowed: {', '.join(FORMS)}")
    if not (math.isfinite(delta) and 0.0 <= delta <= 1.0):
        raise ValueError(f"delta {delta} is outside [0, 1]")
    if not (math.isfinite(lam) and lam >= 1.0):
        raise ValueError(f"lambda {lam} must be a finite number >= 1")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k {k!r} must be an integer >= 0")


@dataclass(frozen=True)
class Acceptance:
    kind: str = "exact"
    k: int = 0
    delta: float = 0.0
    lam: float = 1.0
    form: str = "bounded"
    proximity: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)  # (V, K) any integer type
    _links: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # device -> NeighbourLinks

    def __post_init__(self):
        check_rule(self.kind, self.k, self.delta, self.lam, self.form)
        if self.relaxed:
            if self.proximity is None:
                raise ValueError(f"acceptance {self.kind!r} needs a proximity table (built from the VQ codebook)")
            if self.k > self.proximity.shape[1]:
                raise ValueError(f"k {self.k} exceeds the proximity table's {self.proximity.shape[1]} neighbours; "
                                 f"allowed: 0..{self.proximity.shape[1]}")

    @property
    def relaxed(self) -> bool:
        if self.kind == "lantern":
            return self.k > 0 and self.delta > 0
        return self.kind == "lantern++" and self.k > 0 and self.lam > 1

    @property
    def paper(self) -> bool:
        """LANTERN's own per-candidate rule (else the exact rule, against p_hat where relaxed)."""
        return self.relaxed and self.form == "paper"

    @property
    def bounds(self) -> tuple[Optional[float], Optional[float]]:
        """(delta, lam): the one that applies, the other None."""
        return (self.delta, None) if self.kind == "lantern" else (None, self.lam)

    def neighbours(self, device, count: Optional[int] = None) -> torch.Tensor:
        """(V, count) on `device` (count: k when None, at most the table's width), in the table's own integer type
        (indexed directly; only gathered ids are widened). The paper form reads k + 1: a rejection clears them."""
        if self.proximity.is_floating_point() or self.proximity.dtype == torch.bool:
            raise ValueError(f"a proximity table holds integer code ids, not {self.proximity.dtype}")
        near = self.proximity[:, : self.k if count is None else count]
        return near if near.device == torch.device(device) else near.to(device)

    def links(self, device) -> NeighbourLinks:
        """The bounded relaxation's neighbour lists on `device`, kept with the rule (what they build, once)."""
        key = torch.device(device)
        if key not in self._links:
            self._links[key] = NeighbourLinks(self.neighbours(device))
        return self._links[key]


@dataclass
class DraftedTree:
    """One verify step's tree for B images. Shared structure may have a leading dim of 1."""

    tokens: torch.Tensor  # (B, N) node tokens, root first
    valid: torch.Tensor  # (B, N) bool: a real candidate (padding and missing candidates are never accepted)
    depth: torch.Tensor  # (B|1, N) int64 depth from the root
    ancestors: torch.Tensor  # (B|1, N, N) bool: j is i or an ancestor of i
    parents: torch.Tensor  # (B|1, M) node ids that may have children (-1: none)
    children: torch.Tensor  # (B|1, M, C) their children's node ids in rank order (-1: none)
    q: Optional[Support]  # (B, M, Kq) what each parent's children were drawn from; None = deterministic top-k
    max_depth: int  # D: the deepest a node can be (static)
    rank: torch.Tensor  # (B|1, N) int64 child rank of each node among its siblings (root: -1 or 0)
    chain: bool = False  # node i's one child is node i + 1, no padding (static): the path is a prefix
    rows_at_rank: Optional[tuple[int, ...]] = None  # CompiledTree.rows_at_rank (static); None: every row, every rank


@dataclass
class StepAcceptance:
    path: torch.Tensor  # (B, D+1) node ids on the accepted path by depth (0 past its end)
    accepted: torch.Tensor  # (B,) m: accepted draft tokens
    bonus: torch.Tensor  # (B,) the token after the last accepted node
    tried: torch.Tensor  # (B, D) bool: children were tried at depth d + 1
    token_tv: torch.Tensor  # (B, D+1) TV(p_hat, p) of the distribution each emitted token came from
    boost: torch.Tensor  # (B, D) papers' rule: the boost each accepted draft used (0 otherwise)


def draft_distribution(q_on_support: torch.Tensor, earlier: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """q_i on the support (B, M, K): q without the earlier candidates (`earlier` marks them), renormalised by
    the q mass `removed` (B, M) they held."""
    return q_on_support.masked_fill(earlier, 0.0) / (1.0 - removed).clamp_min(1e-12)[..., None]


def residual(r: torch.Tensor, q: torch.Tensor, tried: torch.Tensor, uniform_if_empty: bool = False) -> torch.Tensor:
    """r, q (..., K) on the same support, tried (...) bool -> normalise(max(r - q, 0)) where a candidate drawn
    from q was tried (and rejected), else r. Nothing left: r (the exact rules, where rejection then had
    probability 0), or with `uniform_if_empty` (the paper form, whose clearing can empty it) uniform on the
    support."""
    nxt = (r - q).clamp_min(0.0)
    total = nxt.sum(-1, keepdim=True)
    if uniform_if_empty:
        nxt = torch.where(total > 0, nxt, 1.0)
        total = nxt.sum(-1, keepdim=True)
    return torch.where(tried[..., None] & (total > 0), nxt / total.clamp_min(1e-30), r)


class LastCandidate(NamedTuple):
    """Each parent's rule before its last candidate: the distribution a bonus is drawn from after every valid
    child was rejected is the residual against that candidate, computed only at the rows a bonus is drawn at."""

    r: Support  # (B, M, K) the target the last candidate was tested against
    q: Optional[torch.Tensor] = None  # (B, M, K) what its rejection subtracts, on r's support (None: r is drawn)
    tried: Optional[torch.Tensor] = None  # (B, M) bool: it is a valid candidate
    uniform_if_empty: bool = False  # the paper form: a residual left empty is uniform

    def rejected(self, rows: torch.Tensor) -> Support:
        """rows (B, 1) -> (B, 1, K) the distribution after every valid child at those rows was rejected."""
        r = self.r.index(rows)
        if self.q is None:
            return r
        return Support(residual(r.probs, self.q.gather(1, rows[..., None].expand_as(r.probs)),
                                self.tried.gather(1, rows), self.uniform_if_empty), r.ids)


class Leftover(NamedTuple):
    """Each parent's residual after all its candidates, from `_recursive_rejection`'s closed form: a support token
    never tried holds (r - level * q)+, a tried one what it held when it was tried; computed only at the rows a
    bonus is drawn at."""

    r: Support  # (B, M, K) the target
    q: torch.Tensor  # (B, M, K) what the candidates were drawn from, on r's support
    level: torch.Tensor  # (B, M) the level after the last candidate
    drafted: torch.Tensor  # (B, M, K) bool: the support tokens that were valid candidates
    slot: torch.Tensor  # (B, M, C) each candidate's index in r's support
    kept: torch.Tensor  # (B, M, C) the mass each candidate held when it was tried (0 off the support)

    def rejected(self, rows: torch.Tensor) -> Support:
        """rows (B, 1) -> (B, 1, K) the distribution after every valid child at those rows was rejected."""
        r = self.r.index(rows)
        per_token = rows[..., None].expand_as(r.probs)
        q, tried = self.q.gather(1, per_token), self.drafted.gather(1, per_token)
        per_kid = rows[..., None].expand(*rows.shape, self.slot.shape[-1])
        kept = torch.zeros_like(r.probs).scatter_add_(-1, self.slot.gather(1, per_kid), self.kept.gather(1, per_kid))
        untried = (r.probs - self.level.gather(1, rows)[..., None] * q).clamp_min(0.0)
        left = torch.where(tried, kept, untried)
        total = left.sum(-1, keepdim=True)
        return Support(torch.where(total > 0, left / total.clamp_min(1e-30), r.probs), r.ids)


def earlier_mass(q_x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, M, C) each candidate's probability under q, which are candidates -> the q mass the earlier valid
    candidates held (B, M, C): what q_i, the distribution candidate i was drawn from, lost (a product with a
    triangular matrix, not a scan)."""
    rank = torch.arange(q_x.shape[-1], device=q_x.device)
    return torch.where(valid, q_x, 0.0) @ (rank[:, None] < rank[None]).to(q_x.dtype)


def _recursive_rejection(target: Support, cand, cvalid, q_at: SupportLookup, q_sup: torch.Tensor, vocab: int,
                         rows_at_rank: Optional[tuple[int, ...]] = None):
    """The exact rule (recursive rejection) for sampled drafts: acceptance probabilities (B, M, C) and each
    parent's Leftover, without rewriting a (B, M, K) residual per candidate.

    Let U_j be the residual before candidate j, unnormalised (U_0 = r, mass S_j), and R_j the q mass of the
    earlier candidates: candidate j was drawn from q_j = q [not earlier] / (1 - R_j), and its rejection leaves
    U_{j+1} = (U_j - a_j q [not earlier])+ with a_j = S_j / (1 - R_j). As (max(x - a, 0) - b)+ = (x - a - b)+,
    a token not tried yet holds (r - A_j q)+ at the level A_j = a_0 + .. + a_{j-1}, and a tried one keeps what
    it held when tried. Candidate x_j is accepted with min(1, r_j(x) / q_j(x)) = min(1, (r(x) - A_j q(x))+ /
    (a_j q(x))). So a rank reads the support once, for the mass of the tokens never among the candidates, sum
    (r - A q)+, and its candidates' (B, M, C) values; no residual is rewritten or renormalised. A rejection that
    would leave nothing (then it had probability 0) leaves the residual as it was, as `residual` does. Rank j
    reads only the first rows_at_rank[j] parents (static; by default all): no later one has a j-th candidate, and
    a parent's level is final once its rows are left behind."""
    r = target.probs
    slot, found = target.lookup(vocab).position(cand)
    on = cvalid & found
    r_x = torch.where(on, r.gather(-1, slot), 0.0)  # (B, M, C) the target at each candidate
    q_x = torch.where(cvalid, q_at.prob(cand), 0.0)
    drafted = torch.zeros_like(r).scatter_add_(-1, slot, on.to(r.dtype)) > 0  # (B, M, K); not found: adds 0
    rest_r, rest_q = r.masked_fill(drafted, 0.0), q_sup.masked_fill(drafted, 0.0)  # tokens never candidates
    kept_q = (1.0 - earlier_mass(q_x, cvalid)).clamp_min(1e-12)
    m, c = cand.shape[1:]
    ahead = (torch.arange(c, device=r.device)[None] >= torch.arange(c, device=r.device)[:, None]).to(r.dtype)
    level, mass = torch.zeros_like(r[..., 0]), r.sum(-1)
    kept_total = torch.zeros_like(level)
    levels, scales, kept = [], [], []  # per rank j, (B, n_j) each
    final = []  # the levels of the parents left behind, last rows first
    rx, qx, valid, share = r_x, q_x, cvalid, kept_q  # the rows rank j reads
    for j, n in enumerate(rows_at_rank or (m,) * c):
        if n < level.shape[1]:
            final.append(level[:, n:])
            level, mass, kept_total, rx, qx, valid, share, rest_r, rest_q = (
                x[:, :n] for x in (level, mass, kept_total, rx, qx, valid, share, rest_r, rest_q))
        scale = mass / share[..., j]
        levels.append(level)
        scales.append(scale)
        trial = level + torch.where(valid[..., j], scale, 0.0)
        live = torch.addcmul(rx, trial[..., None], qx, value=-1.0).clamp_min(0.0)  # (B, n, C) at `trial`
        untried = torch.addcmul(rest_r, trial[..., None], rest_q, value=-1.0).clamp_min(0.0).sum(-1)
        left = untried + live @ ahead[j] + kept_total  # candidate j and later ones are not tried yet
        ok = left > 0
        level, mass = torch.where(ok, trial, level), torch.where(ok, left, mass)
        kept.append(torch.addcmul(rx[..., j], level, qx[..., j], value=-1.0).clamp_min(0.0))  # r_x 0: 0
        kept_total = kept_total + kept[-1]
    at, per = by_rank(levels, m), by_rank(scales, m)
    acc = ((r_x - at * q_x).clamp_min(0.0) / (per * q_x).clamp_min(1e-30)).clamp(max=1.0)
    level = torch.cat([level, *final[::-1]], 1) if final else level
    return torch.where(cvalid, acc, 0.0), Leftover(target, q_sup, level, drafted, slot, by_rank(kept, m))


def by_rank(values: list, m: int) -> torch.Tensor:
    """Per rank j, (B, n_j) values of the first n_j of m rows (n_j never growing) -> (B, m, C), 0 past n_j: ranks
    with the same rows stacked at once."""
    runs, start = [], 0
    for end in range(1, len(values) + 1):
        if end == len(values) or values[end].shape[1] != values[start].shape[1]:
            run = torch.stack(values[start:end], -1)
            runs.append(torch.nn.functional.pad(run, (0, 0, 0, m - run.shape[1])) if run.shape[1] < m else run)
            start = end
    return torch.cat(runs, -1) if len(runs) > 1 else runs[0]


def _acceptance_sampling(target: Support, cand, cvalid, q_at: Optional[SupportLookup],
                         q_sup: Optional[torch.Tensor], rule: Acceptance):
    """The paper form's rule, deterministic drafts and one child a parent, one candidate rank after another:
    acceptance probabilities (B, M, C), papers' boosts (B, M, C; None for other rules) and the rule before each
    parent's last candidate; q_at: where the draft distribution holds each token, q_sup (B, M, K): it on the
    target's support (both None: deterministic drafts)."""
    r, ids = target.probs, target.ids
    acc, boost = [], []  # per candidate (B, M), stacked once at the end: no buffer written per candidate
    removed = earlier = None  # the q mass (B, M) and the support tokens (B, M, K) of the candidates tried
    last = LastCandidate(target)
    near = rule.neighbours(r.device, rule.k + 1) if rule.paper else None
    for j in range(cand.shape[-1]):
        if j:  # candidate j is tested against the residual after candidate j - 1 was rejected
            r = residual(r, last.q, last.tried, last.uniform_if_empty)
        x, v = cand[..., j], cvalid[..., j]
        hit = ids == x[..., None]  # (B, M, K)
        if q_at is None:  # a deterministic draft: x was "drawn" with certainty
            q_x, q_j = torch.ones(x.shape, dtype=r.dtype, device=r.device), hit.to(r.dtype)
        else:
            q_drawn = q_at.prob(x[..., None])[..., 0]
            if earlier is None:  # the first candidate was drawn from q itself
                q_x, q_j = q_drawn, q_sup
            else:
                q_x = q_drawn / (1.0 - removed).clamp_min(1e-12)
                q_j = draft_distribution(q_sup, earlier, removed)
        if rule.paper:
            test = paper_test(Support(r, ids), x, near, rule.k, *rule.bounds)
            p_tilde = test.p_tilde
            boost.append(torch.where(v, test.boost, 0.0))
            # LANTERN's rejection clears x's k + 1 nearest codes: from the residual itself for a deterministic
            # draft (q_i, a point mass, becomes 1 there: (r - 1)+ = 0), from q_i before it is subtracted otherwise
            q_j = (hit | test.cleared).to(r.dtype) if q_at is None else q_j.masked_fill(test.cleared, 0.0)
        else:
            p_tilde = (r * hit).sum(-1)
        acc.append(torch.where(v, (p_tilde / q_x.clamp_min(1e-30)).clamp(max=1.0), 0.0))  # min(1, p~/q_i)
        last = LastCandidate(Support(r, ids), q_j, v, rule.paper)
        if q_at is not None and j + 1 < cand.shape[-1]:  # the next candidate was drawn without this one
            mass, drawn = torch.where(v, q_drawn, 0.0), hit & v[..., None]
            removed, earlier = (mass, drawn) if earlier is None else (removed + mass, earlier | drawn)
    return torch.stack(acc, -1), torch.stack(boost, -1) if rule.paper else None, last


def _acceptance_greedy(target: Support, cand, cvalid, rule: Acceptance):
    """Greedy: a child is accepted iff it is the argmax (of p_hat), or for the paper form iff its boosted
    probability reaches the best other token's (LANTERN's argmax after the boost). Returns (B, M, C) in {0, 1}
    and the boosts (None for other rules)."""
    if rule.paper:
        top = torch.topk(target.probs, min(2, target.probs.shape[-1]), dim=-1)  # (B, M, 2) on the support
        first = target.ids.gather(-1, top.indices[..., :1])[..., 0]
        second = top.values[..., 1] if top.values.shape[-1] > 1 else torch.zeros_like(top.values[..., 0])
        acc, boost = [], []
        near = rule.neighbours(cand.device)
        for j in range(cand.shape[-1]):
            x = cand[..., j]
            p_tilde, b, _ = paper_test(target, x, near, rule.k, *rule.bounds)
            other = torch.where(first == x, second, top.values[..., 0])
            acc.append((p_tilde >= other).float())
            boost.append(b)
        return torch.stack(acc, -1) * cvalid, torch.stack(boost, -1) * cvalid
    return (cand == draw(target, True, None)[..., None]).float() * cvalid, None


def _rule(p: Support, cand: torch.Tensor, cvalid: torch.Tensor, q: Optional[Support], rule: Acceptance,
          greedy: bool, vocab: int, rows_at_rank: Optional[tuple[int, ...]] = None):
    """The rule at M parents: p (B, M, K) their distributions, cand/cvalid (B, M, C) their children in rank
    order, q (B, M, K) what the children were drawn from (None: deterministic drafts), rows_at_rank as
    DraftedTree's. Returns acceptance
    probabilities (B, M, C), the rule before each parent's last candidate (LastCandidate, on p's support), the
    papers' boosts (B, M, C) and TV(p_hat, p) (B, M), each None where the rule has none."""
    target, tv = p, None
    q_at = q.lookup(vocab) if q is not None else None  # built once, read by the relaxation and the rule
    q_sup = q_at.prob(p.ids) if q_at is not None else None  # (B, M, K) q on p's support
    if rule.relaxed and not rule.paper:
        near = rule.links(cand.device)
        if q_at is not None:
            p_hat, tv = bounded_target(p, q_sup, near, vocab, *rule.bounds)
        else:  # deterministic drafts: the fixed candidate set plays q, and only a candidate can receive
            slot, found = p.lookup().position(cand)
            drafted = (found & cvalid).to(p.probs.dtype)
            drafted_sup = torch.zeros_like(p.probs).scatter_add_(2, slot, drafted).clamp(max=1.0)
            p_hat, tv = bounded_target(p, drafted_sup, near, vocab, *rule.bounds, receivers=slot)
        target = Support(p_hat, p.ids)
    if greedy:
        acc, boost = _acceptance_greedy(target, cand, cvalid, rule)
        return acc, LastCandidate(target), boost, tv
    if q_at is not None and not rule.paper and cand.shape[-1] > 1:  # siblings (one child: tested directly)
        acc, left = _recursive_rejection(target, cand, cvalid, q_at, q_sup, vocab, rows_at_rank)
        return acc, left, None, tv
    acc, boost, last = _acceptance_sampling(target, cand, cvalid, q_at, q_sup, rule)
    return acc, last, boost, tv


def accept(p_nodes, tree: DraftedTree, rule: Acceptance, greedy: bool, generator: Draws,
           vocab: int) -> StepAcceptance:
    """p_nodes: the target's (guided, warped) distribution after every node, anything with `.index(idx (B, M))
    -> Support (B, M, K)`: a Support (B, N, K), or GuidedLogits that warp only the nodes read."""
    b, n = tree.tokens.shape
    dev = tree.tokens.device
    parents = tree.parents.expand(b, -1)
    kids = tree.children.expand(b, -1, -1)  # (B, M, C)
    m_rows, c = kids.shape[1:]
    kid_ids = kids.clamp_min(0)
    cvalid = (kids >= 0) & (parents >= 0)[..., None] & tree.valid.gather(1, kid_ids.flatten(1)).view(b, m_rows, c)
    cand = tree.tokens.gather(1, kid_ids.flatten(1)).view(b, m_rows, c)
    p = p_nodes.index(parents.clamp_min(0))  # (B, M, K)
    acc, last, boost, tv = _rule(p, cand, cvalid, tree.q, rule, greedy, vocab, tree.rows_at_rank)
    u = uniform(generator, acc.shape, dev)
    path, accepted = _accepted_path(tree, (u < acc) & cvalid, kids)

    max_depth = tree.max_depth
    final = path.gather(1, accepted[:, None])  # (B, 1) the last accepted node
    rows = torch.arange(m_rows, device=dev).expand(b, m_rows)
    final_row = _at_nodes(parents, rows, final, -1)  # its parent row, -1 if it has no children
    end, at_final = last.rejected(final_row.clamp_min(0)), p_nodes.index(final)
    has_row = (final_row >= 0)[..., None]
    bonus_dist = Support(torch.where(has_row, end.probs, at_final.probs), torch.where(has_row, end.ids, at_final.ids))
    bonus = draw(bonus_dist, greedy, generator)[:, 0]

    depths = torch.arange(max_depth, device=dev)
    tried = (depths[None] <= accepted[:, None]) & _at_nodes(parents, cvalid.any(-1), path[:, :max_depth], False)
    emitted = torch.arange(max_depth + 1, device=dev)[None] <= accepted[:, None]
    token_tv = torch.zeros(b, max_depth + 1, device=dev)
    if tv is not None:
        token_tv = torch.where(emitted, _at_nodes(parents, tv, path, 0.0), 0.0)
    boost_path = torch.zeros(b, max_depth, device=dev)
    if boost is not None:
        boost_path = torch.where(emitted[:, 1:], _at_nodes(kids.flatten(1), boost.flatten(1), path[:, 1:], 0.0), 0.0)
    return StepAcceptance(path=path, accepted=accepted, bonus=bonus, tried=tried, token_tv=token_tv,
                          boost=boost_path)


def _accepted_path(tree: DraftedTree, ok: torch.Tensor, kids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ok (B, M, C): each parent's children that passed their test -> the accepted path (B, D+1), node ids by
    depth (0 past its end), and its length in drafts (B,). A child is taken iff it passed and every earlier
    sibling failed; a node is on the path iff it and every ancestor were taken. On a chain that is the prefix
    up to the first failure."""
    b, n = tree.tokens.shape
    dev = ok.device
    nodes = torch.arange(n, device=dev)
    if tree.chain:
        leading = ok[..., 0]  # (B, L): the first failure's index, L if none, is the accepted prefix's length
        accepted = torch.where(leading, leading.shape[-1], nodes[:leading.shape[-1]]).amin(-1)
        return torch.where(nodes[None] <= accepted[:, None], nodes[None], 0), accepted
    first = ok.int().argmax(-1)  # first accepted sibling (rank order)
    taken_kid = torch.where(ok.any(-1), kids.gather(2, first[..., None])[..., 0], -1)  # (B, M)
    taken = _at_nodes(taken_kid, torch.ones_like(taken_kid, dtype=torch.bool), nodes.expand(b, n), False) | (nodes == 0)
    on_path = ~(tree.ancestors & ~taken[:, None, :]).any(-1)  # (B, N): every ancestor taken
    at_depth = on_path[:, None, :] & (tree.depth[:, None, :] == torch.arange(tree.max_depth + 1, device=dev)[:, None])
    path = torch.where(at_depth, nodes, 0).sum(-1)  # (B, D+1): the one node on the path at each depth, 0 past its end
    return path, torch.where(on_path, tree.depth, 0).amax(-1)


def _at_nodes(nodes: torch.Tensor, values: torch.Tensor, at: torch.Tensor, fill) -> torch.Tensor:
    """(B, M) values at node ids `nodes` (-1: none; an id at most once a row) -> (B, A) the value at each node id
    of `at` (B, A), `fill` where `nodes` holds none. One masked reduction over M: no scatter, nothing per node."""
    hit = nodes[:, None, :] == at[..., None]  # (B, A, M)
    if values.dtype == torch.bool:
        found = (hit & values[:, None, :]).any(-1)
    else:
        found = torch.where(hit, values[:, None, :], 0).sum(-1, dtype=values.dtype)  # the one match, or 0
    return torch.where(hit.any(-1), found, fill)
