"""The quality frontier of the relaxed rules on the embedded model, and the bundle's relaxation defaults.

For LANTERN (k, delta) and LANTERN++ (k, lambda), in lantern's bounded form and the papers' form, and relaxed
Jacobi (MC-SJD L=16 with the LANTERN++ or the LANTERN rule, bounded), measure step
compression, tau, class accuracy, Frechet distance and the recorded true TV per token, next to AR over several
seeds (AR's own spread). Not a timing: it can run beside other work. `--only` runs some rows and keeps the
other rows of the results file, as it is when the run ends, that were measured on the same target (and drafter,
for drafter methods): runs of disjoint rows can go side by side. The default relaxation of each method is
the bounded setting with the largest step compression whose accuracy and Frechet distance stay within AR's
spread (accuracy >= AR's lowest, distance <= AR's highest); `--write-defaults` records it in the bundle's
manifest ("relaxation_defaults"), which `lantern generate` then uses. Writes results/frontier.{json,md,png}.

    python tools/quality_frontier.py [--per-class 10] [--ar-seeds 3] [--write-defaults]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from lantern import atomic_io
from lantern.api import Pipeline
from lantern.bundle import DEFAULT_BUNDLE, load_bundle, weights_hash
from lantern.decoding import SamplingConfig, method_preset
from lantern.evaluate import evaluate
from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
GRID = [  # (label, method, overrides)
    ("eagle2 exact", "eagle2", {}),
    ("lantern++-57 exact", "lantern++", dict(acceptance="exact")),
    *[(f"lantern++ bounded lam={lam}", "lantern++", dict(lam=lam, form="bounded")) for lam in (1.5, 2.0, 3.0, 5.0)],
    *[(f"lantern++ paper lam={lam}", "lantern++", dict(lam=lam, form="paper")) for lam in (2.0, 3.0)],
    *[(f"lantern bounded delta={d}", "lantern", dict(delta=d, form="bounded")) for d in (0.05, 0.1, 0.2)],
    ("lantern paper delta=0.1", "lantern", dict(delta=0.1, form="paper")),
    ("mc-sjd L16 exact", "mc-sjd", dict(window=16)),
    *[(f"mc-sjd-relaxed bounded lam={lam}", "mc-sjd-relaxed", dict(window=16, lam=lam, form="bounded"))
      for lam in (2.0, 3.0)],
    *[(f"mc-sjd-relaxed lantern bounded delta={d}", "mc-sjd-relaxed",
       dict(window=16, acceptance="lantern", k=1000, delta=d, form="bounded"))
      for d in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)],  # 1.0: no cap, each token's recorded TV is its bound
]
RELAXED = ("lantern", "lantern++", "mc-sjd-relaxed")  # the methods that get a default relaxation


def run(pipe, bundle, dcfg, per_class: int, seed: int, batch: int) -> dict:
    stats = []

    def generate(class_ids, s):
        res = pipe.generate(class_ids.tolist(), dcfg, seed=s, batch=batch)
        stats.append(res.stats)
        return res.tokens

    q = evaluate(bundle, generate, n_per_class=per_class, seed=seed, batch_size=10 * per_class)
    images = [i for s in stats for i in s.images]
    tv = [x for s in stats for x in s.token_tv]
    tokens, forwards = sum(i.tokens for i in images), sum(i.target_forwards for i in images)
    lengths = [x for i in images for x in i.accepted_lengths]
    return {"class_accuracy": q["generated"]["class_accuracy"], "frechet_distance": q["generated"]["frechet_distance"],
            "step_compression": tokens / forwards, "tau": sum(lengths) / len(lengths) if lengths else 1.0,
            "token_tv_mean": sum(tv) / len(tv) if tv else 0.0, "token_tv_max": max(tv, default=0.0),
            "images": len(images), "real_reference": q["real_train_reference"]}


def choose(rows: list[dict], spread: dict) -> dict:
    """Per method, the bounded row with the largest step compression whose quality is within AR's spread."""
    out = {}
    for method in RELAXED:
        ok = [r for r in rows if r["method"] == method and r["overrides"].get("form") == "bounded"
              and r["class_accuracy"] >= spread["accuracy_min"] and r["frechet_distance"] <= spread["frechet_max"]]
        if ok:
            best = max(ok, key=lambda r: r["step_compression"])
            out[method] = {"settings": best["decode_overrides"], "evidence": {
                k: best[k] for k in ("label", "step_compression", "tau", "class_accuracy", "frechet_distance",
                                     "token_tv_mean")} | {"ar_spread": spread}}
    return out


def kept_rows(path: Path, models: dict, sampling: dict, rerun: list[str]) -> list[dict]:
    """The rows of the results at `path` that `--only` does not rerun and that still hold: measured at these
    sampling settings on this target, and on this drafter if they use one (rows saved before rows said
    whether they do count as using one)."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    if old.get("target_hash") != models["target_hash"] or old.get("sampling") != sampling:
        return []
    same_drafter = old.get("drafter_hash") == models["drafter_hash"]
    return [r for r in old["rows"] if r["label"] not in rerun and r["label"] in {g[0] for g in GRID}
            and (same_drafter or not r.get("needs_drafter", True))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-class", type=int, default=10, help="images per class per run")
    ap.add_argument("--ar-seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=50, help="images per static step")
    ap.add_argument("--only", nargs="+", metavar="LABEL", help="run only these rows of the grid (default: all)")
    ap.add_argument("--write-defaults", action="store_true", help="record the chosen defaults in the bundle")
    ap.add_argument("--out", default=str(ROOT / "results" / "frontier"))
    args = ap.parse_args()
    bundle = load_bundle()
    pipe = Pipeline(bundle.target, bundle.drafter, bundle.proximity, backend="cpu")
    sc = SamplingConfig(**bundle.default_sampling)
    ar = [run(pipe, bundle, method_preset("ar", sc), args.per_class, seed, args.batch)
          for seed in tqdm(range(args.ar_seeds), desc="AR seeds")]
    spread = {"accuracy_min": min(r["class_accuracy"] for r in ar), "accuracy_max": max(r["class_accuracy"] for r in ar),
              "frechet_min": min(r["frechet_distance"] for r in ar), "frechet_max": max(r["frechet_distance"] for r in ar)}
    models = {"target_hash": weights_hash(bundle.target.state_dict()),
              "drafter_hash": weights_hash(bundle.drafter.state_dict()) if bundle.drafter is not None else None}
    rows = []
    grid = [g for g in GRID if args.only is None or g[0] in args.only]
    unknown = set(args.only or ()) - {g[0] for g in GRID}
    if unknown:
        raise SystemExit(f"unknown grid rows {sorted(unknown)}; allowed: {[g[0] for g in GRID]}")
    for label, method, overrides in tqdm(grid, desc="relaxations"):
        dcfg = method_preset(method, sc, **overrides)
        decode = {k: getattr(dcfg, k) for k in ("acceptance", "k", "delta", "lam", "form")
                  if k in ("k", "form") or k in overrides}
        rows.append({"label": label, "method": method, "overrides": overrides, "decode_overrides": decode,
                     "needs_drafter": dcfg.needs_drafter, **run(pipe, bundle, dcfg, args.per_class, 0, args.batch)})
    if args.only:  # read at the end, so runs of other rows that finished meanwhile are kept too
        rows += kept_rows(Path(args.out).with_suffix(".json"), models, bundle.default_sampling, args.only)
    rows.sort(key=lambda r: [g[0] for g in GRID].index(r["label"]))
    chosen = choose(rows, spread)
    record = {"date": utc_now(), "bundle": bundle.manifest.get("name"), **models, "sampling": bundle.default_sampling,
              "per_class": args.per_class, "ar": ar, "ar_spread": spread, "rows": rows, "chosen": chosen}
    write_results(args.out, record, markdown, plot)
    if args.write_defaults:
        path = DEFAULT_BUNDLE / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["relaxation_defaults"] = chosen
        atomic_io.write_text(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def markdown(rec: dict) -> str:
    s = rec["ar_spread"]
    lines = [f"Embedded model, torch eager cpu, sampling {rec['sampling']}; {10 * rec['per_class']} images per run; "
             f"{rec['date']}. AR over {len(rec['ar'])} seeds: class accuracy {s['accuracy_min']:.3f}-"
             f"{s['accuracy_max']:.3f}, Frechet distance {s['frechet_min']:.2f}-{s['frechet_max']:.2f} (its spread).",
             "", "| method | step compression | tau | class acc. | Frechet dist. | mean token TV (recorded) | within AR's "
             "spread |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rec["ar"]):
        lines.append(f"| AR seed {i} | 1.00 | 1.00 | {r['class_accuracy']:.3f} | {r['frechet_distance']:.2f} | 0 | - |")
    for r in rec["rows"]:
        within = r["class_accuracy"] >= s["accuracy_min"] and r["frechet_distance"] <= s["frechet_max"]
        tv = f"{r['token_tv_mean']:.4f}" if r["overrides"].get("form") != "paper" else "not bounded"
        lines.append(f"| {r['label']} | {r['step_compression']:.2f} | {r['tau']:.2f} | {r['class_accuracy']:.3f} | "
                     f"{r['frechet_distance']:.2f} | {tv} | {'yes' if within else 'no'} |")
    lines += ["", "Chosen defaults (bounded form, largest step compression within AR's spread):", ""]
    lines += [f"- {m}: {c['settings']} ({c['evidence']['label']}, step compression "
              f"{c['evidence']['step_compression']:.2f})" for m, c in rec["chosen"].items()] or ["- none qualified"]
    return "\n".join(lines) + "\n"


def family(row: dict) -> str:
    """A sweep's name: the method, its rule and form ("lantern++ bounded", "mc-sjd-relaxed lantern paper")."""
    o = row["overrides"]
    rule = o.get("acceptance", "") if row["method"] == "mc-sjd-relaxed" else ""
    return " ".join(x for x in (row["method"], rule, o.get("form", "exact")) if x)


def setting_text(row: dict) -> str:
    """The swept setting of a row ("δ=0.2", "λ=3.0"), empty for an exact method."""
    o = row["overrides"]
    return f"δ={o['delta']}" if "delta" in o else f"λ={o['lam']}" if "lam" in o else ""


def plot(rec: dict, path: Path) -> None:
    """Both quality measures against step compression: one colour and line per sweep (a method, rule and form,
    in order of its setting), each point named by its setting, the chosen defaults ringed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = rec["ar_spread"]
    chosen = {c["evidence"]["label"] for c in rec["chosen"].values()}
    sweeps = {}
    for r in rec["rows"]:
        sweeps.setdefault(family(r), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, lo, hi, name in ((axes[0], "frechet_distance", s["frechet_min"], s["frechet_max"], "Frechet distance"),
                                  (axes[1], "class_accuracy", s["accuracy_min"], s["accuracy_max"], "class accuracy")):
        ax.axhspan(lo, hi, color="gray", alpha=0.2, label="AR's spread over seeds")
        for i, (fam, rows) in enumerate(sweeps.items()):
            xs, ys = [r["step_compression"] for r in rows], [r[key] for r in rows]
            marker = {"bounded": "o", "paper": "x"}.get(rows[0]["overrides"].get("form"), "s")
            ax.plot(xs, ys, marker=marker, color=f"C{i % 10}", lw=0.8, ms=5, label=fam)
            for r in rows:
                if r["label"] in chosen:
                    ax.scatter(r["step_compression"], r[key], s=140, facecolors="none", edgecolors="black")
                ax.annotate(setting_text(r), (r["step_compression"], r[key]), fontsize=6, color=f"C{i % 10}",
                            textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("step compression (tokens per target forward)")
        ax.set_ylabel(name)
    axes[1].scatter([], [], s=140, facecolors="none", edgecolors="black", label="chosen default")
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
