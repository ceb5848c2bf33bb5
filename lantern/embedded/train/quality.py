"""Sample quality while a bundle is built: AR samples through the Pipeline, scored by lantern.embedded.evaluate,
cached in the work dir (codes and report), and the rule that picks the bundle's sampling defaults from a sweep."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lantern.files import atomic_io
from lantern.bundle import Bundle
from lantern.embedded.evaluate import evaluate
from lantern.models.checkpoint import weights_hash
from lantern.embedded.train.selfsample import ar_sampler
from lantern.embedded.train.tokens import read_metadata

ACCURACY_SLACK = 0.02  # candidates this close to the best class accuracy compete on Frechet distance


def sampling_name(sampling: dict) -> str:
    return "_".join(f"{k}{sampling[k]:g}" for k in sorted(sampling))


def cached_evaluation(work: str | Path, bundle: Bundle, sampling: dict, n_per_class: int, seed: int,
                      batch_size: int = 100) -> tuple[dict, torch.Tensor]:
    """`lantern.embedded.evaluate.evaluate` of AR samples at `sampling` -> (report, codes (classes * n_per_class, L)),
    cached as `<work>/evaluations/<seed>_<sampling>.safetensors` (codes; report and key as JSON metadata)."""
    folder = Path(work) / "evaluations"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"seed{seed}_{sampling_name(sampling)}.safetensors"
    key = json.dumps({"sampling": sampling, "n_per_class": n_per_class, "seed": seed, "batch_size": batch_size,
                      "target_hash": weights_hash(bundle.target.state_dict())}, sort_keys=True)
    if path.exists() and read_metadata(path).get("key") == key:
        return json.loads(read_metadata(path)["report"]), load_file(str(path))["codes"]
    generate, chunks = ar_sampler(bundle.target, sampling), []

    def generate_and_keep(class_ids: torch.Tensor, chunk_seed: int) -> torch.Tensor:
        chunks.append(generate(class_ids, chunk_seed))
        return chunks[-1]

    report = evaluate(bundle, generate_and_keep, n_per_class=n_per_class, seed=seed, batch_size=batch_size)
    report["sampling"] = sampling
    codes = torch.cat(chunks).contiguous()
    with atomic_io.atomic_path(path) as tmp:
        save_file({"codes": codes}, str(tmp), metadata={"key": key, "report": json.dumps(report)})
    return report, codes


def choose_sampling(reports: list[dict]) -> dict:
    """The candidate with the lowest Frechet distance among those whose class accuracy is within
    ACCURACY_SLACK of the best one (Frechet distance counts diversity as well as fidelity)."""
    best_accuracy = max(r["generated"]["class_accuracy"] for r in reports)
    eligible = [r for r in reports if r["generated"]["class_accuracy"] >= best_accuracy - ACCURACY_SLACK]
    return min(eligible, key=lambda r: r["generated"]["frechet_distance"])["sampling"]
