"""The two relaxation forms at equal (k, delta): output TV to the target and acceptance, on smooth synthetic targets.

`--relaxation paper` is LANTERN's own rule (its per-candidate boost, and after a rejection the rejected code's
k + 1 nearest codes cleared); `--relaxation bounded` (the default) is the exact rule against a fixed relaxed
target p_hat. One node, many independent trials (tests/node_trials.py, one batch row per trial): the acceptance
rate is the share of trials whose node accepted a draft, and the output TV is TV(empirical first output, p),
whose floor is the sampling noise (the exact rule's row). Counting only, no timing.

Targets: a random 2-D codebook of V codes; p = softmax(-|c - m|^2 / spread + noise) around a random point m, so
latent neighbours hold similar mass (LANTERN's setting); the drafter's q is p's logits plus Gaussian noise. Drafts:
the top C of q (EAGLE-2's dynamic tree: LANTERN's `evaluate_posterior`) or C drawn from q without replacement
(the static tree: `evaluate_posterior_v1`). k is LANTERN's default share of the codebook (1000 of 16384).

    python tools/paper_rule_tvd.py [--vocab 1024] [--pairs 4] [--trials 20000]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from results_io import utc_now, write_results

from lantern.decoding.acceptance import Acceptance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the acceptance tests' instrument
from node_trials import one_node_trials  # noqa: E402

CHUNK = 5000  # trials per batch (memory: a few (CHUNK, V) tensors per candidate)


def smooth_pairs(n: int, v: int, seed: int, spread: float = 0.01, draft_noise: float = 1.0):
    """The codebook's neighbour table (V, V - 1), nearest first, and n (p, q) pairs smooth over it."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.rand(v, 2, generator=g)
    d = torch.cdist(codes, codes)
    neighbours = torch.argsort(d, dim=1)[:, 1:]  # self excluded
    pairs = []
    for _ in range(n):
        centre = torch.rand(1, 2, generator=g)
        logits = -torch.cdist(centre, codes)[0] ** 2 / spread + 0.5 * torch.randn(v, generator=g)
        pairs.append((torch.softmax(logits, -1), torch.softmax(logits + draft_noise * torch.randn(v, generator=g), -1)))
    return neighbours, pairs


def measure(pairs, rule: Acceptance, children: int, deterministic: bool, trials: int, seed: int) -> dict:
    acc, tv = [], []
    for p, q in pairs:
        counts = torch.zeros_like(p)
        accepted = 0
        for start in range(0, trials, CHUNK):
            n = min(CHUNK, trials - start)
            first, out = one_node_trials(p, q, children, rule, n, seed + start, deterministic=deterministic)
            counts += torch.bincount(first, minlength=p.shape[0]).float()
            accepted += int((out.accepted > 0).sum())
        acc.append(accepted / trials)
        tv.append(0.5 * float((counts / trials - p).abs().sum()))
    return {"acceptance": sum(acc) / len(acc), "output_tv": sum(tv) / len(tv)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--trials", type=int, default=20000)
    ap.add_argument("--children", type=int, default=4, help="candidates per node")
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--out", default=str(ROOT / "results" / "paper_rule_tvd"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    k = max(1, round(args.vocab * 1000 / 16384))  # LANTERN's k = 1000 of LlamaGen's 16384 codes
    neighbours, pairs = smooth_pairs(args.pairs, args.vocab, seed=0)
    rules = {"exact": Acceptance("exact"),
             "bounded": Acceptance("lantern", k=k, delta=args.delta, proximity=neighbours),
             "paper": Acceptance("lantern", k=k, delta=args.delta, form="paper", proximity=neighbours)}
    rows = []
    for drafts, deterministic in (("top-C of q (EAGLE-2 path)", True), ("C drawn from q (static path)", False)):
        for form, rule in rules.items():
            rows.append({"drafts": drafts, "form": form,
                         **measure(pairs, rule, args.children, deterministic, args.trials, seed=11)})
    write_results(args.out, {"date": utc_now(), "vocab": args.vocab, "k": k, "delta": args.delta,
                             "children": args.children, "pairs": args.pairs, "trials": args.trials, "rows": rows},
                  markdown)


def markdown(rec: dict) -> str:
    lines = [f"LANTERN (k = {rec['k']} of V = {rec['vocab']} codes, delta = {rec['delta']}), {rec['children']} "
             f"candidates, {rec['pairs']} smooth (p, q) pairs, {rec['trials']} trials each; {rec['date']}. Output TV "
             "is measured from the output samples (the exact rule's row is the noise floor).", "",
             "| drafts | form | acceptance | output TV |", "|---|---|---|---|"]
    lines += [f"| {r['drafts']} | {r['form']} | {r['acceptance']:.3f} | {r['output_tv']:.3f} |" for r in rec["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
