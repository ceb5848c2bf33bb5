"""Choose the static tree for one device from its measurements, one tree per batch size B (images decoded
together: one batched step advances all of them). A tree T's step costs what lantern.plan.cost_model's CostModel
says (the curves measured at B, the host work fitted on the whole generations at B), and it yields E(T) = 1 + sum
over nodes of the product of the batch-1 probe's acceptance rates a[d][j] along its path; a greedy search grows
the tree from (0,) by the node that gives the highest E / cost, up to the largest N measured at B, and keeps the
best tree it passed (docs/profiles.md, "How `tune` chooses").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from lantern.decoding.trees import Paths, validate_paths
from lantern.plan.cost_model import CostModel, fit_host_overhead, tree_shape
from lantern.profile.schema import (batch_sizes, generation_case_id, generations, ok_result, seconds_per_step,
                                    step_latencies)


@dataclass(frozen=True)
class AcceptanceRates:
    rates: tuple[tuple[float, ...], ...]  # rates[d - 1][j]: a[d][j]

    @property
    def max_depth(self) -> int:
        return len(self.rates)

    @property
    def max_rank(self) -> int:
        return max(len(r) for r in self.rates)

    def rate(self, depth: int, rank: int) -> float:
        if depth > len(self.rates) or rank >= len(self.rates[depth - 1]):
            return 0.0  # never measured: never counted on
        return self.rates[depth - 1][rank]

    def path_probability(self, path: Sequence[int]) -> float:
        return math.prod(self.rate(d, j) for d, j in enumerate(path, start=1))


def evaluate(paths: Paths, acc: AcceptanceRates, cost: CostModel) -> dict:
    n, depth, width = tree_shape(paths)
    tau = 1.0 + sum(acc.path_probability(p) for p in paths)
    step = cost.step_seconds(n, depth, width)
    return {"N": n, "depth": depth, "draft_width": width, "tau": tau, "step_s": step, "tokens_per_s": tau / step}


def choose_tree(acc: AcceptanceRates, cost: CostModel, max_nodes: Optional[int] = None) -> dict:
    """Greedy growth (see the module doc). Returns the best tree and its predicted numbers."""
    max_nodes = min(max_nodes or cost.max_nodes, cost.max_nodes)
    if max_nodes < 2:
        raise ValueError(f"the verify curve must reach N >= 2 to choose a tree (largest measured N: {max_nodes})")
    paths, children = [(0,)], {(): 1, (0,): 0}  # children: a path -> how many it has
    best = (evaluate(tuple(paths), acc, cost)["tokens_per_s"], list(paths))
    while len(paths) + 1 < max_nodes:
        grown = [u + (k,) for u, k in children.items() if k < acc.max_rank and len(u) < acc.max_depth]
        if not grown:
            break
        # the highest E / cost, then the likeliest node, then the lowest ranks
        thr, _, c = max(((evaluate((*paths, c), acc, cost)["tokens_per_s"], acc.path_probability(c), c)
                         for c in grown), key=lambda s: (s[0], s[1], [-r for r in s[2]]))
        children[c[:-1]] += 1
        children[c] = 0
        paths.append(c)
        if thr > best[0]:
            best = (thr, list(paths))
    paths = validate_paths(best[1])
    return {"paths": paths, **evaluate(paths, acc, cost)}


# -- from a results file -------------------------------------------------------------------------------------
def cost_model(data: dict, batch: int) -> tuple[CostModel, list[dict]]:
    """The curves at `batch` images ({N: median seconds} of verify, {W: median seconds} of drafter steps) plus host
    overhead fitted on the static-tree generations at that batch size (the residual of each one's measured step
    time over the curves' prediction)."""
    verify, draft = ({size: lat["median_s"] for size, lat in step_latencies(data, kind, batch).items()}
                     for kind in ("verify", "draft"))
    bare = CostModel.from_curves(verify, draft)
    points, used = [], []
    for cid, c in generations(data, batch).items():
        r = c["result"]
        if c["params"]["method"] == "ar" or c["params"]["decode"]["drafting"] in ("dynamic", "jacobi"):
            continue
        residual = seconds_per_step(r) - bare.step_seconds(r["verify_width"], r["tree_depth"], r["draft_width"])
        points.append((r["verify_width"], residual))
        used.append({"case": cid, "N": r["verify_width"], "step_s": seconds_per_step(r), "residual_s": residual})
    a, b = fit_host_overhead(points)
    return CostModel(bare.verify, bare.draft, a, b), used


def acceptance_model(data: dict) -> AcceptanceRates:
    probe = data["cases"].get("acceptance/probe")
    if not probe or probe["status"] != "ok":
        raise ValueError("tuning needs the acceptance/probe case of `lantern profile run` (missing or failed in "
                         "this results file)")
    return AcceptanceRates(tuple(tuple(row) for row in probe["result"]["rates"]))


def ar_seconds_per_token(data: dict, batch: int) -> Optional[float]:
    """AR's wall seconds per token of one image at `batch` images per step (each step gives every image one)."""
    r = ok_result(data, generation_case_id(batch, "ar"))
    if r is None:
        return None
    tokens_per_image = r["tokens_per_pass"] / r["images"]
    return sum(r["wall"]["samples_s"]) / (tokens_per_image * r["wall"]["repeats"])


def tune_batch(data: dict, batch: int, acc: AcceptanceRates, presets: dict, max_nodes: Optional[int] = None) -> dict:
    """The tree chosen for `batch` images per step and, under the same model, every preset (for comparison).
    Speed-ups are per image against AR at the same batch size. The model counts tau tokens per image and step;
    the batched loop runs until its slowest image is done, so at B > 1 the predictions are upper bounds."""
    cost, host_points = cost_model(data, batch)
    choice = choose_tree(acc, cost, max_nodes)
    ar = ar_seconds_per_token(data, batch)
    rows = {name: evaluate(tuple(paths), acc, cost) for name, paths in presets.items()
            if len(paths) + 1 <= cost.max_nodes}
    for row in [choice, *rows.values()]:
        row["predicted_speedup_vs_ar"] = row["tokens_per_s"] * ar if ar else None
    return {"choice": choice, "presets": rows, "ar_seconds_per_token": ar,
            "cost_model": {"verify": cost.verify, "draft": cost.draft, "host_a_s": cost.host_a,
                           "host_b_s_per_node": cost.host_b, "host_fit": host_points}}


def tune_results(data: dict, presets: dict, max_nodes: Optional[int] = None) -> dict:
    """One tree per batch size with measured curves (the acceptance rates are the batch-1 probe's)."""
    acc = acceptance_model(data)
    batches = sorted(set(batch_sizes(data, "verify")) & set(batch_sizes(data, "draft")))  # with both curves
    if not batches:
        raise ValueError("tuning needs a measured verify curve and drafter curve at some batch size (run `lantern "
                         "profile run`)")
    return {"batches": {b: tune_batch(data, b, acc, presets, max_nodes) for b in batches},
            "acceptance_rates": acc.rates}
