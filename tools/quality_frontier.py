"""The quality frontier of the relaxed rules on the embedded model at one sampling setting, judged by the quality
gate (lantern.embedded.quality_gate), and the bundle's relaxation defaults validated at that setting.

At the sampling given (default: the bundle's own; `--top-k 0 --cfg-scale 4.0` is LANTERN's class-to-image
setting, the whole vocabulary), AR runs over `--ar-seeds` seeds of `--per-class` images per class: its spread
sets the gate's limits. Each row of the grid (bounded forms only, every setting within the bounds of
lantern.plan.validated: delta <= 0.4, k <= 1/16 of the codebook) runs once at the same image count, at a seed
none of AR's, and is gated on class accuracy, Frechet distance and its recorded mean token TV. Per method the
row with the largest step compression that passes is chosen; `--write-defaults` records it in the bundle's
manifest ("relaxation_defaults") with the sampling it was validated at and the gate's verdict as evidence (a
method that passes nothing at this setting loses its entry there). Quality only, never a timing: it can run
beside other work.

Nothing finished is lost: each AR seed is kept in .cache/quality_frontier/ as it finishes, and the results
(results/frontier-<setting>.{json,md,png} and a grid of each run's first images, <stem>-images.png) are written
once AR's reference stands and again after every row. Rerun the same command to resume: AR's seeds are read back,
rows the results file holds against the same AR reference are kept (`--rerun` runs them again).

    python tools/quality_frontier.py [--top-k 0 --cfg-scale 4.0] [--per-class 10] [--ar-seeds 6] [--threads 1]
                                     [--only LABEL ...] [--stop-at HH:MM] [--write-defaults]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from lantern.api import Pipeline
from lantern.backends.environment import provenance
from lantern.bundle import DEFAULT_BUNDLE, load_bundle, weights_hash
from lantern.decoding import SamplingConfig, method_preset
from lantern.embedded.quality_gate import (MIN_AR_SEEDS, Reference, Scored, failed_checks, gate, heldout_features,
                                           measure, sample, score, token_tv_bound)
from lantern.files import atomic_io
from lantern.plan.validated import RELAXED_METHODS, bound_problems, same_sampling, sampling_record
from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
GRID = [  # (label, method, overrides) around the papers' values, in the order a run takes them: each method's most
    # promising row (the loosest bound the papers use) first, then tighter ones
    ("mc-sjd-relaxed lantern k=64 delta=0.4", "mc-sjd-relaxed",
     dict(window=16, acceptance="lantern", k=64, delta=0.4, form="bounded")),
    ("lantern++ k=10 lam=2.0", "lantern++", dict(k=10, lam=2.0, form="bounded")),
    ("lantern k=64 delta=0.4", "lantern", dict(k=64, delta=0.4, form="bounded")),
    ("mc-sjd-relaxed lantern k=64 delta=0.2", "mc-sjd-relaxed",
     dict(window=16, acceptance="lantern", k=64, delta=0.2, form="bounded")),
    ("lantern k=64 delta=0.2", "lantern", dict(k=64, delta=0.2, form="bounded")),
    ("mc-sjd-relaxed lantern k=64 delta=0.1", "mc-sjd-relaxed",
     dict(window=16, acceptance="lantern", k=64, delta=0.1, form="bounded")),
    ("lantern++ k=10 lam=1.5", "lantern++", dict(k=10, lam=1.5, form="bounded")),
]
SHOWN = 10  # images per run in the image grid: one per class
AR_CACHE = ROOT / ".cache" / "quality_frontier"  # AR's runs, one file per seed (ignored by git)
CANDIDATE_SEED = 1000  # every row's seed: none of AR's (0, 1, ...), so no row shares a draw with its reference


def setting_name(sampling: SamplingConfig, vocab: int) -> str:
    """'topk5-cfg3' (the bundle's), 'topkall-cfg4' (the whole vocabulary), plus top-p / temperature if not 1."""
    k = "all" if sampling.support_size(vocab) == vocab else str(sampling.top_k)
    name = f"topk{k}-cfg{sampling.cfg_scale:g}"
    name += f"-topp{sampling.top_p:g}" if sampling.top_p != 1 else ""
    return name + (f"-temp{sampling.temperature:g}" if sampling.temperature != 1 else "")


def run(pipe, bundle, dcfg, per_class: int, seed: int, batch: int):
    """One run: (its images scored, its figures but the gate's, its first image of each class)."""
    stats = []

    def generate(class_ids, s):
        res = pipe.generate(class_ids.tolist(), dcfg, seed=s, batch=batch)
        stats.append(res.stats)
        return res.tokens

    codes, labels = sample(generate, range(bundle.target.config.num_classes), per_class, seed)
    scored = score(bundle, codes, labels)
    images = [i for s in stats for i in s.images]
    tv = [x for s in stats for x in s.token_tv]
    tokens, forwards = sum(i.tokens for i in images), sum(i.target_forwards for i in images)
    lengths = [x for i in images for x in i.accepted_lengths]
    figures = {"step_compression": tokens / forwards, "tau": sum(lengths) / len(lengths) if lengths else 1.0,
               "token_tv_mean": sum(tv) / len(tv) if tv else 0.0, "token_tv_max": max(tv, default=0.0)}
    return scored, figures, codes[::per_class][:SHOWN]


def ar_seed_path(cache: Path, key: dict, seed: int) -> Path:
    """Where AR's run at `seed` is kept: one file per seed and key (sampling, image count, target), so a killed run
    resumes at its first missing seed and a changed setting never reads another's runs."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache / f"ar-{digest}-seed{seed}.npz"


def ar_seed_run(pipe, bundle, sc: SamplingConfig, per_class: int, seed: int, batch: int, path: Path):
    """AR's run at `seed`: (its images scored, its figures, its first images), read from `path` if an earlier run
    left it there, else run and saved there as soon as it finishes."""
    if path.exists():
        kept = np.load(path)
        scored = Scored(kept["features"], kept["predicted"], kept["labels"])
        return scored, json.loads(str(kept["figures"])), torch.from_numpy(kept["shown"])
    scored, figures, first = run(pipe, bundle, method_preset("ar", sc), per_class, seed, batch)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npz")
    np.savez(partial, features=scored.features, predicted=scored.predicted, labels=scored.labels,
             figures=json.dumps(figures), shown=first.numpy())
    partial.replace(path)
    return scored, figures, first


def ar_reference(pipe, bundle, sc: SamplingConfig, per_class: int, seeds: int, batch: int, heldout: np.ndarray,
                 cache: Path, key: dict) -> tuple[list[dict], dict]:
    """AR over `seeds` seeds (each kept in `cache` as it finishes): each seed's figures and first images, and the
    gate's reference (its spread and limits, plus each seed gated against a reference of the others)."""
    scored, ar_runs = [], []
    for seed in tqdm(range(seeds), desc="AR seeds"):
        runs, figures, first = ar_seed_run(pipe, bundle, sc, per_class, seed, batch, ar_seed_path(cache, key, seed))
        scored.append(runs)
        ar_runs.append({**measure(runs, heldout).to_dict(), **figures, "shown": first.tolist()})
    ref = Reference.of(scored, heldout)
    if seeds > MIN_AR_SEEDS:  # AR itself must pass: each seed against the others
        for i, r in enumerate(ar_runs):
            others = Reference.of(scored[:i] + scored[i + 1:], heldout)
            verdict = gate(others, measure(scored[i], heldout))
            r["gated_against_the_others"] = {"passed": verdict["passed"], "failed": failed_checks(verdict)}
    return ar_runs, ref.to_dict()


REFERENCE_KEYS = ("sampling", "per_class", "target_hash", "drafter_hash", "ar_spread")


def finished_rows(path: Path, rec: dict) -> list[dict]:
    """The rows of the results at `path` gated against the same AR reference as `rec` (same sampling, image count,
    target and drafter, and the same AR figures) that are still in the grid: what a resumed run keeps."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    same = all(old.get(k) == rec[k] for k in REFERENCE_KEYS)
    return [r for r in old["rows"] if r["label"] in {g[0] for g in GRID}] if same else []


def choose(rows: list[dict]) -> dict:
    """Per method, the row with the largest step compression that passed the gate."""
    out = {}
    for method in RELAXED_METHODS:
        ok = [r for r in rows if r["method"] == method and r["gate"]["passed"]]
        if ok:
            out[method] = max(ok, key=lambda r: r["step_compression"])
    return out


def manifest_entry(row: dict, sampling: dict, rec: dict) -> dict:
    return {"settings": row["decode_overrides"], "sampling": sampling, "evidence": {
        "label": row["label"], "gate": "lantern.embedded.quality_gate (tools/quality_frontier.py)",
        "passed_checks": {k: {"value": c["value"], "limit": c["limit"]} for k, c in row["gate"]["checks"].items()},
        "step_compression": row["step_compression"], "tau": row["tau"], "images": row["n"],
        "ar_spread": rec["ar_spread"], "results": rec["results"], "date": rec["date"], "commit": rec["commit"]}}


def write_defaults(chosen: dict, sampling: SamplingConfig, vocab: int, rec: dict) -> None:
    """Replace each relaxed method's entry at this sampling by the chosen one (none if nothing passed); entries
    validated at other samplings stay, entries without a sampling record are dropped."""
    path = DEFAULT_BUNDLE / "manifest.json"
    manifest = json.loads(path.read_text())
    old = manifest.get("relaxation_defaults", {})
    new = {}
    for method in RELAXED_METHODS:
        entries = old.get(method, [])
        kept = [e for e in (entries if isinstance(entries, list) else [entries])
                if e.get("sampling") is not None and not same_sampling(e["sampling"], sampling, vocab)]
        if method in chosen:
            kept.append(manifest_entry(chosen[method], sampling_record(sampling), rec))
        if kept:
            new[method] = kept
    manifest["relaxation_defaults"] = new
    atomic_io.write_text(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--top-k", type=int, help="default: the bundle's (0: the whole vocabulary)")
    ap.add_argument("--top-p", type=float, help="default: the bundle's")
    ap.add_argument("--temperature", type=float, help="default: the bundle's")
    ap.add_argument("--cfg-scale", type=float, help="default: the bundle's")
    ap.add_argument("--per-class", type=int, default=10, help="images per class per run")
    ap.add_argument("--ar-seeds", type=int, default=6, help="AR runs (seeds 0, 1, ...) the gate's limits come from")
    ap.add_argument("--ar-batch", type=int, default=100, help="AR's images per static step")
    ap.add_argument("--batch", type=int, default=20, help="a row's images per static step")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; 1 on a loaded machine)")
    ap.add_argument("--only", nargs="*", metavar="LABEL",
                    help="run only these rows of the grid, in this order (default: all; none: AR alone, e.g. to "
                         "--write-defaults from the rows the results file holds)")
    ap.add_argument("--rerun", action="store_true",
                    help="rerun rows the results file already holds against the same AR (default: keep them)")
    ap.add_argument("--stop-at", metavar="HH:MM", help="start no row after this UTC time")
    ap.add_argument("--write-defaults", action="store_true", help="record the chosen defaults in the bundle")
    ap.add_argument("--out", help="output stem (default results/frontier-<setting>)")
    args = ap.parse_args()
    labels = [g[0] for g in GRID]
    unknown = set(args.only or ()) - set(labels)
    if unknown:
        raise SystemExit(f"unknown grid rows {sorted(unknown)}; allowed: {labels}")
    if args.ar_seeds >= CANDIDATE_SEED:
        raise SystemExit(f"--ar-seeds {args.ar_seeds}: AR's seeds must stay below the rows' seed {CANDIDATE_SEED}")
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_bundle()
    vocab = bundle.target.config.vocab_size
    given = {"top_k": args.top_k, "top_p": args.top_p, "temperature": args.temperature, "cfg_scale": args.cfg_scale}
    sc = SamplingConfig(**{k: bundle.default_sampling[k] if v is None else v for k, v in given.items()})
    name = setting_name(sc, vocab)
    out = Path(args.out) if args.out else ROOT / "results" / f"frontier-{name}"
    pipe = Pipeline(bundle.target, bundle.drafter, bundle.proximity, backend="cpu")
    heldout = heldout_features(bundle)
    target_hash = weights_hash(bundle.target.state_dict())
    key = {"sampling": sampling_record(sc), "per_class": args.per_class, "target_hash": target_hash}
    ar_runs, spread = ar_reference(pipe, bundle, sc, args.per_class, args.ar_seeds, args.ar_batch, heldout,
                                   AR_CACHE, key)
    ref = Reference(spread)
    rec = {"date": utc_now(), "setting": name, "bundle": bundle.manifest.get("name"), "target_hash": target_hash,
           "drafter_hash": weights_hash(bundle.drafter.state_dict()) if bundle.drafter is not None else None,
           "sampling": sampling_record(sc), "vocab": vocab, "per_class": args.per_class, "row_seed": CANDIDATE_SEED,
           "ar": ar_runs, "ar_spread": spread,
           "results": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
           "commit": provenance()["commit"]}
    done = {} if args.rerun else {r["label"]: r for r in finished_rows(out.with_suffix(".json"), rec)}
    todo = [next(g for g in GRID if g[0] == label) for label in (labels if args.only is None else args.only)]
    todo = [g for g in todo if g[0] not in done]
    print(f"{len(done)} rows kept from {out.with_suffix('.json')}; to run: {[g[0] for g in todo]}", flush=True)
    ran = []
    publish(bundle, rec, ran, out)  # AR's reference as soon as it stands
    for label, method, overrides in tqdm(todo, desc="rows"):
        if args.stop_at and time.strftime("%H:%M", time.gmtime()) >= args.stop_at:
            print(f"{utc_now()}: past --stop-at {args.stop_at}; not started: {label} and after", flush=True)
            break
        dcfg = method_preset(method, sc, **overrides)
        assert not bound_problems(dcfg, vocab), (label, bound_problems(dcfg, vocab))  # the grid bounds something
        scored, figures, first = run(pipe, bundle, dcfg, args.per_class, CANDIDATE_SEED, args.batch)
        m = measure(scored, heldout)
        verdict = gate(ref, m, figures["token_tv_mean"], token_tv_bound(dcfg.acceptance, dcfg.delta, dcfg.form))
        decode = {k: getattr(dcfg, k) for k in ("acceptance", "k", "delta", "lam", "form")
                  if k in ("k", "form") or k in overrides}
        ran.append({"label": label, "method": method, "overrides": overrides, "decode_overrides": decode,
                    **m.to_dict(), **figures, "gate": verdict, "failed": failed_checks(verdict),
                    "shown": first.tolist(), "provenance": provenance()})
        print(f"{utc_now()}: {label}: {'pass' if verdict['passed'] else 'FAIL ' + str(failed_checks(verdict))}",
              flush=True)
        publish(bundle, rec, ran, out)
    if args.write_defaults and rec["rows"]:  # AR alone chose nothing: the bundle's entries stay
        write_defaults({m: next(r for r in rec["rows"] if r["label"] == label) for m, label in rec["chosen"].items()},
                       sc, vocab, rec)


def publish(bundle, rec: dict, ran: list[dict], out: Path) -> None:
    """Write the results with every row gated against this AR reference: the rows run here and those the file
    holds (a resumed run's, or a run's beside this one), in the grid's order; updates rec's rows and choice."""
    ours = {r["label"] for r in ran}
    rows = ran + [r for r in finished_rows(out.with_suffix(".json"), rec) if r["label"] not in ours]
    rows.sort(key=lambda r: [g[0] for g in GRID].index(r["label"]))
    rec.update(rows=rows, chosen={m: r["label"] for m, r in choose(rows).items()})
    write_results(out, rec, markdown, plot)
    image_grid(bundle, {**{f"AR seed {i}": r["shown"] for i, r in enumerate(rec["ar"])},
                        **{r["label"]: r["shown"] for r in rows}}, Path(f"{out}-images.png"))


def markdown(rec: dict) -> str:
    s = rec["ar_spread"]
    acc, fd = s["accuracy_per_seed"], s["frechet_per_seed"]
    lines = [f"Embedded model (vocabulary {rec['vocab']}), torch eager cpu fp32, sampling {rec['sampling']}; "
             f"{s['images_per_run']} images per run; {rec['date']}.",
             "",
             f"AR over {s['seeds']} seeds (0-{s['seeds'] - 1}; every row runs at seed {rec['row_seed']}): class "
             f"accuracy {min(acc):.3f}-{max(acc):.3f} (seed-to-seed sd {s['accuracy_seed_sd']:.3f}; pooled "
             f"{s['accuracy_mean']:.3f}, one run's binomial sd {s['accuracy_sd']:.3f}), Frechet distance "
             f"{min(fd):.2f}-{max(fd):.2f} (seed-to-seed sd {s['frechet_seed_sd']:.2f}; over {s['partitions']} random "
             f"splits of AR's {s['seeds'] * s['images_per_run']} images into runs of {s['images_per_run']}: mean "
             f"{s['frechet_mean']:.2f}, sd {s['frechet_sd']:.2f}). Gate (lantern.embedded.quality_gate, Z = "
             f"{s['z']:g}, the mean's own error included: {s['margin_sds']:.2f} sd): class accuracy >= "
             f"{s['accuracy_limit']:.3f}, Frechet distance <= {s['frechet_limit']:.2f}, mean recorded token TV <= the "
             f"setting's bound (delta, at most 0.4).",
             "", "| run | step compression | tau | class acc. | Frechet dist. | mean token TV | max token TV | gate |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rec["ar"]):
        own = r.get("gated_against_the_others")
        check = "" if own is None else "; against the other seeds: " + (
            "pass" if own["passed"] else "FAIL: " + "; ".join(own["failed"]))
        lines.append(f"| AR seed {i} | 1.00 | 1.00 | {r['class_accuracy']:.3f} | {r['frechet_distance']:.2f} | 0 | "
                     f"0 | (reference{check}) |")
    for r in rec["rows"]:
        verdict = "pass" if r["gate"]["passed"] else "FAIL: " + "; ".join(r["failed"])
        lines.append(f"| {r['label']} | {r['step_compression']:.2f} | {r['tau']:.2f} | {r['class_accuracy']:.3f} | "
                     f"{r['frechet_distance']:.2f} | {r['token_tv_mean']:.4f} | {r['token_tv_max']:.4f} | "
                     f"{verdict} |")
    lines += ["", "Chosen (per method, the largest step compression that passed the gate):", ""]
    lines += [f"- {m}: {label}" for m, label in rec["chosen"].items()] or ["- none passed"]
    missing = [m for m in RELAXED_METHODS if m not in rec["chosen"]]
    if missing:
        lines.append(f"- {', '.join(missing)}: none passed (or none run): lossless at this setting")
    runs = {}
    for r in rec["rows"]:
        runs.setdefault((r["provenance"]["commit"], r["provenance"]["command"]), []).append(r["label"])
    if runs:
        lines += ["", "Rows run by:", ""] + [f"- `{command}` (commit {commit}): {', '.join(labels)}"
                                             for (commit, command), labels in runs.items()]
    return "\n".join(lines) + "\n"


def plot(rec: dict, path: Path) -> None:
    """Frechet distance and class accuracy against step compression per row, the gate's limits as lines and AR's
    seeds as grey points; chosen rows ringed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = rec["ar_spread"]
    chosen = set(rec["chosen"].values())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, limit, name in ((axes[0], "frechet_distance", s["frechet_limit"], "Frechet distance"),
                                 (axes[1], "class_accuracy", s["accuracy_limit"], "class accuracy")):
        ax.scatter([1.0] * len(rec["ar"]), [r[key] for r in rec["ar"]], color="gray", label="AR (seeds)")
        ax.axhline(limit, color="red", ls="--", lw=1, label="gate limit")
        for i, r in enumerate(rec["rows"]):
            ax.scatter(r["step_compression"], r[key], color=f"C{i % 10}", marker="o" if r["gate"]["passed"] else "x",
                       label=r["label"])
            if r["label"] in chosen:
                ax.scatter(r["step_compression"], r[key], s=160, facecolors="none", edgecolors="black")
        ax.set_xlabel("step compression (tokens per target forward)")
        ax.set_ylabel(name)
        ax.set_title(f"{name}, sampling {rec['setting']}")
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def image_grid(bundle, shown: dict, path: Path) -> None:
    """One row per run (its first image of each class), named on the left."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 0.9 * len(shown)))
    for ax, (label, codes) in zip(np.atleast_1d(axes), shown.items()):
        images = bundle.decode_images(torch.as_tensor(codes))  # (n, H, W, 3)
        ax.imshow(np.concatenate(list(images), axis=1))
        ax.set_axis_off()
        ax.set_title(label, fontsize=7, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
