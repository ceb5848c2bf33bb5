"""`lantern train drafter --bundle B`: a drafter for any c2i bundle (an imported LlamaGen one too), by the recipe
that built the embedded drafter: the target's own samples (batched AR at the bundle's sampling) as data, the
frozen target's features, EAGLE-1's loss (lantern.embedded.train.drafter), with its progress bars, checkpoints and
resume; samples are cached by chunk, so an interrupted run resumes its sampling too.

Writes `<work>/drafter.safetensors` with the target's weights hash (what `lantern import --drafter` and bundles
check); with `install`, also puts it into the bundle and updates the bundle's manifest.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from lantern.bundle import load_bundle, sha256_file
from lantern.files.reading import read_json_object
from lantern.models.checkpoint import weights_hash
from lantern.embedded.train.drafter import train_drafter
from lantern.embedded.train.selfsample import self_samples


def train_bundle_drafter(bundle_path: str | Path, work: str | Path, steps: int, batch: int, lr: float, seed: int,
                         bf16: bool, per_class: int, chunks: int, install: bool, progress: bool = True) -> dict:
    bundle = load_bundle(bundle_path)
    target = bundle.target
    if target.config.model_type != "c2i":
        raise ValueError(f"bundle {bundle_path} is {target.config.model_type}: self-distillation samples by class "
                         f"id, so it trains drafters for c2i bundles only")
    if chunks < 2 or per_class < 1:
        raise ValueError(f"--chunks {chunks} must be >= 2 (the last is held out) and --per-class {per_class} >= 1")
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    sampling = bundle.default_sampling
    tokens, labels = self_samples(work, target, sampling, per_class, chunks, seed, progress=progress)
    n_held = len(tokens) // chunks
    report = train_drafter(str(work), target, tokens[:-n_held], labels[:-n_held], (tokens[-n_held:], labels[-n_held:]),
                           steps=steps, batch=batch, lr=lr, seed=seed, bf16=bf16, progress=progress)
    out = work / "drafter.safetensors"
    target_hash = weights_hash(target.state_dict())
    save_file(load_file(str(out)), str(out), metadata={"target_hash": target_hash})
    report["drafter"] = str(out)
    if install:
        install_drafter(Path(bundle_path), out)
        report["installed_into"] = str(bundle_path)
    return report


def install_drafter(bundle: Path, drafter: Path) -> None:
    """Copy the drafter into the bundle and record its sha256 in the manifest (the drafter's own options stay
    lantern's defaults: this recipe trains lantern's drafter)."""
    config = read_json_object(bundle / "config.json")
    if "drafter" in config:
        raise ValueError(f"bundle {bundle} holds a drafter of another architecture ({config['drafter']}); import the "
                         f"bundle again with --drafter {drafter} instead")
    shutil.copyfile(drafter, bundle / "drafter.safetensors")
    manifest = read_json_object(bundle / "manifest.json")
    manifest["files"]["drafter.safetensors"] = sha256_file(bundle / "drafter.safetensors")
    tmp = bundle / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(bundle / "manifest.json")
