"""Acceptance vs TRUE output distortion of the relaxed rules: the papers' per-candidate LANTERN / LANTERN++ rules
against lantern's bounded relaxation, side by side, at equal true TV (never at equal delta).

For a node with target p and draft q, many independent trials of the real acceptance program (one batch, one
row per trial; tests/node_trials.py) give the acceptance rate and the empirical output distribution,
whose total variation to p is the true distortion (the exact rule's row is the sampling-noise floor). For the
bounded rule the recorded TV(p_hat, p) is reported next to it: the two must agree.

Settings: flat synthetic distributions (Dirichlet 0.3 and peaked Dirichlet 0.05 over 256 codes of a random
4-D codebook, k = 8) and the embedded model's own (p, q) pairs (teacher-forced on AR samples, CFG and warping
at the bundle's defaults, the bundle's proximity table, k = 10). Writes results/relaxation_tvd.{json,md,png}.

    python tools/relaxation_tvd.py [--pairs 20] [--trials 20000]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from results_io import utc_now, write_results

from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding import SamplingConfig, method_preset
from lantern.decoding.acceptance import Acceptance
from lantern.decoding.sampling import target_support

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the acceptance tests' instrument
from node_trials import one_node_trials  # noqa: E402
DELTAS = (0.02, 0.05, 0.1, 0.2, 0.4)
LAMBDAS = (1.5, 2.0, 3.0, 5.0, 10.0)


def synthetic_pairs(n: int, v: int, alpha: float, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    d = torch.distributions.Dirichlet(torch.full((v,), alpha))
    return [(d.sample(), d.sample()) for _ in range(n)]


def codebook_neighbours(v: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randn(v, 4, generator=g)
    return torch.argsort(torch.cdist(codes, codes), dim=1)[:, 1:]


@torch.no_grad()
def embedded_pairs(n: int, seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """(p, q) at random positions of AR samples of the bundle: target and drafter distributions after CFG and
    warping, teacher-forced (what the drafter sees at a root after its catch-up)."""
    from lantern.embedded.train.drafter import drafter_pass
    bundle = load_bundle()
    sc = SamplingConfig(**bundle.default_sampling)
    target, drafter = bundle.target, bundle.drafter
    classes = list(range(target.config.num_classes))
    tokens = Pipeline(target, drafter, bundle.proximity, backend="cpu").generate(
        classes, method_preset("ar", sc), seed=seed).tokens  # (C, L)
    cond = torch.tensor(classes)
    null = target.null_condition(len(classes))
    logits, hiddens = [], []
    for c in (cond, null):  # [cond; uncond] rows, LlamaGen's layout
        lg, h = target.forward_full(tokens[:, :-1], c)
        logits.append(lg)
        hiddens.append(h)
    P = target.config.cls_token_num
    v = target.config.vocab_size
    p_all = target_support(torch.cat(logits)[:, P:-1], sc).dense(v)  # (C, L-2, V): index j predicts token j + 1
    q_feats = torch.cat([drafter_pass(drafter, target, tokens, h)[0] for h in hiddens])  # j: guess of feature j + 1
    q_all = target_support(target.head(q_feats), sc).dense(v)  # (C, L-1, V): index j predicts token j + 1
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        img = int(torch.randint(len(classes), (), generator=g))
        t = int(torch.randint(p_all.shape[1], (), generator=g))
        pairs.append((p_all[img, t], q_all[img, t]))
    return pairs, bundle.proximity.long()


def rules(neighbours: torch.Tensor, k: int) -> dict[str, Acceptance]:
    out = {"exact": Acceptance("exact")}
    for form in ("bounded", "paper"):
        for d in DELTAS:
            out[f"{form} lantern delta={d}"] = Acceptance("lantern", k=k, delta=d, form=form, proximity=neighbours)
        for lam in LAMBDAS:
            out[f"{form} lantern++ lambda={lam}"] = Acceptance("lantern++", k=k, lam=lam, form=form,
                                                               proximity=neighbours)
    return out


def measure(pairs, rule: Acceptance, children: int, trials: int, seed: int) -> dict:
    acc, tvd, recorded = [], [], []
    for i, (p, q) in enumerate(pairs):
        first, out = one_node_trials(p, q, children, rule, trials, seed + i)
        freq = torch.bincount(first, minlength=p.shape[0]).float() / trials
        acc.append(float((out.accepted > 0).float().mean()))
        tvd.append(0.5 * float((freq - p).abs().sum()))
        recorded.append(float(out.token_tv[:, 0].mean()))
    n = len(pairs)
    return {"acceptance": sum(acc) / n, "true_tvd": sum(tvd) / n, "recorded_tv": sum(recorded) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--trials", type=int, default=20000)
    ap.add_argument("--children", type=int, nargs="+", default=[1, 3], help="candidates per node")
    ap.add_argument("--out", default=str(ROOT / "results" / "relaxation_tvd"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    v = 256
    settings = {"flat Dirichlet(0.3), V=256, k=8": (synthetic_pairs(args.pairs, v, 0.3, 1), codebook_neighbours(v), 8),
                "peaked Dirichlet(0.05), V=256, k=8": (synthetic_pairs(args.pairs, v, 0.05, 2), codebook_neighbours(v), 8)}
    pairs, prox = embedded_pairs(args.pairs, seed=0)
    settings["embedded model (bundle defaults), k=10"] = (pairs, prox, 10)
    rows = []
    for name, (pairs, neighbours, k) in settings.items():
        for children in args.children:
            for label, rule in tqdm(rules(neighbours, k).items(), desc=f"{name}, {children} cand."):
                rows.append({"setting": name, "children": children, "rule": label, "kind": rule.kind,
                             "form": rule.form if rule.relaxed else "exact", "delta": rule.delta, "lam": rule.lam,
                             **measure(pairs, rule, children, args.trials, seed=7)})
    write_results(args.out, {"date": utc_now(), "pairs": args.pairs, "trials": args.trials, "rows": rows}, markdown, plot)


def markdown(rec: dict) -> str:
    lines = [f"{rec['pairs']} (p, q) pairs per setting, {rec['trials']} trials per pair; {rec['date']}. True TVD is "
             "measured from the output samples (the exact rule's row is the noise floor); recorded TV is what lantern "
             "stores per token (bounded rule: TV(p_hat, p)).", ""]
    for setting in dict.fromkeys(r["setting"] for r in rec["rows"]):
        for children in dict.fromkeys(r["children"] for r in rec["rows"]):
            lines += [f"### {setting}, {children} candidate(s)", "",
                      "| rule | acceptance | true output TVD | recorded TV |", "|---|---|---|---|"]
            for r in rec["rows"]:
                if r["setting"] == setting and r["children"] == children:
                    recorded = "- (no bound)" if r["form"] == "paper" else f"{r['recorded_tv']:.3f}"
                    lines.append(f"| {r['rule']} | {r['acceptance']:.3f} | {r['true_tvd']:.3f} | {recorded} |")
            lines.append("")
    return "\n".join(lines)


def plot(rec: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    settings = list(dict.fromkeys(r["setting"] for r in rec["rows"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.6 * len(settings), 3.8), squeeze=False)
    styles = {("bounded", "lantern"): "o-", ("bounded", "lantern++"): "s-", ("paper", "lantern"): "o--",
              ("paper", "lantern++"): "s--"}
    for ax, setting in zip(axes[0], settings):
        rows = [r for r in rec["rows"] if r["setting"] == setting and r["children"] == 1]
        for (form, kind), style in styles.items():
            sel = [r for r in rows if r["form"] == form and r["kind"] == kind]
            ax.plot([r["true_tvd"] for r in sel], [r["acceptance"] for r in sel], style, label=f"{form} {kind}")
        exact = next(r for r in rows if r["form"] == "exact")
        ax.axvline(exact["true_tvd"], color="gray", lw=0.8, ls=":", label="noise floor")
        ax.scatter([exact["true_tvd"]], [exact["acceptance"]], c="k", zorder=5, label="exact")
        ax.set_title(setting, fontsize=9)
        ax.set_xlabel("true output TVD to p")
        ax.set_ylabel("acceptance (1 candidate)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
