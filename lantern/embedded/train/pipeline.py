"""The whole pipeline behind a bundle: start from a base bundle (its tokenizer and evaluator kept), grow and train
the target, choose the sampling defaults, self-distil the drafter (every stage resumable), then measure and pack."""
from __future__ import annotations

import json
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from lantern.files.images import save_image
from lantern.bundle import Bundle, sha256_file, weights_hash
from lantern.models.config import GPTConfig
from lantern.embedded.data import HELD_OUT_FRACTION, SOURCE, SPLIT_SEED, load_digits_split
from lantern.files.reading import read_json_object
from lantern.models.classifier import Classifier, ClassifierConfig
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT
from lantern.models.vq import VQConfig, VQModel
from lantern.models.proximity import build_proximity_table
from lantern.embedded.train.base import copy_models, import_base, verified_manifest, write_grown_target
from lantern.embedded.train.common import write_json
from lantern.embedded.train.drafter import drafter_report, train_drafter
from lantern.embedded.train.grow import RESIDUAL_OUTPUTS
from lantern.embedded.train.quality import ACCURACY_SLACK, cached_evaluation, choose_sampling
from lantern.embedded.train.selfsample import self_samples
from lantern.embedded.train.target import train_target
from lantern.embedded.train.tokens import token_dataset


@dataclass(frozen=True)
class PipelineSettings:
    seed: int
    gpt: GPTConfig  # the grown target: the base target's config with every layer doubled
    n_aug: int
    target_steps: int
    target_batch: int
    target_lr: float
    sampling_candidates: tuple  # of {"cfg_scale", "temperature", "top_k"} dicts
    selection_seed: int  # the sweep's seed, apart from the final evaluation's (seed)
    selection_per_class: int
    self_sample_chunks: int  # AR batches of the target's own samples, for the drafter
    self_sample_per_class: int  # images of each class per chunk
    self_sample_seed: int
    drafter_steps: int
    drafter_batch: int
    drafter_lr: float
    drafter_self_fraction: float  # share of drafter batches drawn from the self-samples (the rest: real data)
    eval_per_class: int

    @property
    def target_seed(self) -> int:
        return self.seed + 2  # the base target's two phases used seed and seed + 1

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in d.items()}


def load_vq(work: Path) -> VQModel:
    vq = VQModel(VQConfig.from_dict(read_json_object(work / "vq_config.json")))
    vq.load_state_dict(load_file(str(work / "vq.safetensors")))
    return vq.eval()


def load_target(work: Path, name: str = "target") -> GPT:
    target = GPT(GPTConfig.from_dict(read_json_object(work / f"{name}_config.json")))
    target.load_state_dict(load_file(str(work / f"{name}.safetensors")))
    return target.eval()


def load_evaluator(work: Path) -> Classifier:
    evaluator = Classifier(ClassifierConfig.from_dict(read_json_object(work / "evaluator_config.json")))
    evaluator.load_state_dict(load_file(str(work / "evaluator.safetensors")))
    return evaluator.eval()


def work_bundle(work: Path, target_name: str = "target") -> Bundle:
    """The work dir's tokenizer, target and evaluator as a Bundle (no drafter yet), to measure sample quality."""
    vq, target, evaluator = load_vq(work), load_target(work, target_name), load_evaluator(work)
    config = {"vq": vq.config.to_dict(), "target": target.config.to_dict(), "evaluator": evaluator.config.to_dict()}
    return Bundle(work, {}, config, target, None, vq, evaluator, None)


def sweep_record(report: dict) -> dict:
    g = report["generated"]
    return {"sampling": report["sampling"], "class_accuracy": g["class_accuracy"],
            "frechet_distance": g["frechet_distance"], "per_class_accuracy": g["per_class_accuracy"]}


TARGET_SETTINGS = ("seed", "gpt", "n_aug", "target_steps", "target_batch", "target_lr", "sampling_candidates",
                   "selection_seed", "selection_per_class")  # everything the stages before the drafter read


def run_pipeline(work: str | Path, base: str | Path, s: PipelineSettings, progress: bool = True) -> dict:
    """Every training stage into `work`; returns each stage's report plus the chosen sampling defaults."""
    work = Path(work)
    reports = {"base": import_base(work, base)}
    grown = write_grown_target(work)
    if grown != s.gpt:
        raise ValueError(f"the base target grows into {grown}, not the configured {s.gpt}")
    data = token_dataset(load_vq(work), s.n_aug, s.seed, cache_dir=str(work))
    reports["target"] = train_target(str(work), s.gpt, *data["train"], data["heldout"], steps=s.target_steps,
                                     batch=s.target_batch, lr=s.target_lr, seed=s.target_seed, progress=progress,
                                     init_from=str(work / "target_grown.safetensors"), name="target")
    bundle = work_bundle(work)
    sweep = [cached_evaluation(work, bundle, dict(c), s.selection_per_class, s.selection_seed)[0]
             for c in s.sampling_candidates]
    sampling = choose_sampling(sweep)
    reports["sampling"] = {"seed": s.selection_seed, "n_per_class": s.selection_per_class, "chosen": sampling,
                           "rule": f"lowest Frechet distance among candidates within {ACCURACY_SLACK} of the best "
                                   f"class accuracy", "candidates": [sweep_record(r) for r in sweep]}
    reports["drafter"] = distil_drafter(work, s, sampling, progress)
    return reports


def reuse_target(work: str | Path, bundle_dir: str | Path, s: PipelineSettings) -> dict:
    """The stages before the drafter, taken from a bundle this pipeline built with the same settings for them:
    its tokenizer, evaluator and target are copied into `work` and its reports returned, so only the drafter
    stage runs again. Refuses a bundle built with other settings, naming them."""
    work, bundle_dir = Path(work), Path(bundle_dir)
    manifest = verified_manifest(bundle_dir)
    ours = s.to_dict()
    differ = [k for k in TARGET_SETTINGS if manifest.get("settings", {}).get(k) != json.loads(json.dumps(ours[k]))]
    if differ:
        raise ValueError(f"bundle {bundle_dir} was built with other settings for {', '.join(differ)}: "
                         f"its target cannot be reused")
    copy_models(bundle_dir, work, {name: name for name in ("vq", "evaluator", "target")})
    base = manifest["base"]
    return {"base": {"files": base["files"], "command": base["command"], "stages": manifest["base_stages"]},
            "target": manifest["stages"]["target"], "sampling": manifest["stages"]["sampling"],
            "reused_from": {"command": manifest["command"], "target_sha256": manifest["files"]["target.safetensors"]}}


def distil_drafter(work: Path, s: PipelineSettings, sampling: dict, progress: bool = True) -> dict:
    """The drafter stage: the target's own samples (batched AR) plus the real data, on `work`'s target."""
    bundle = work_bundle(work)
    data = token_dataset(load_vq(work), s.n_aug, s.seed, cache_dir=str(work))
    # the final evaluation's samples (seed s.seed) are drawn now: they double as the drafter's held-out self-samples
    _, eval_codes = cached_evaluation(work, bundle, sampling, s.eval_per_class, seed=s.seed)
    eval_labels = torch.arange(s.gpt.num_classes).repeat_interleave(s.eval_per_class)
    self_tokens, self_labels = self_samples(work, bundle.target, sampling, s.self_sample_per_class,
                                            s.self_sample_chunks, s.self_sample_seed, progress=progress)
    real_tokens, real_labels = data["train"]
    weights = torch.cat([torch.full((len(real_tokens),), (1 - s.drafter_self_fraction) / len(real_tokens)),
                         torch.full((len(self_tokens),), s.drafter_self_fraction / len(self_tokens))])
    report = train_drafter(str(work), bundle.target, torch.cat([real_tokens, self_tokens]),
                           torch.cat([real_labels, self_labels]), data["heldout"], steps=s.drafter_steps,
                           batch=s.drafter_batch, lr=s.drafter_lr, seed=s.seed, progress=progress,
                           sample_weights=weights)
    drafter = Drafter(s.gpt)
    drafter.load_state_dict(load_file(str(work / "drafter.safetensors")))
    on_self = drafter_report(drafter, bundle.target, eval_codes, eval_labels)
    report.update({f"self_samples_{k}": v for k, v in on_self.items()},
                  data={"real_sequences": len(real_tokens), "self_sample_sequences": len(self_tokens),
                        "self_sample_heldout": f"the {len(eval_codes)} samples of the final evaluation (seed {s.seed})",
                        "self_fraction": s.drafter_self_fraction, "self_sampling": sampling})
    return report


def sample_grid(rows: list[list[np.ndarray]], scale: int = 2) -> Image.Image:
    """rows of (H, W, 3) uint8 images -> one PNG-ready grid, each tile upscaled by `scale` (nearest)."""
    grid = np.concatenate([np.concatenate(r, axis=1) for r in rows], axis=0)
    img = Image.fromarray(grid)
    return img.resize((img.width * scale, img.height * scale), Image.NEAREST)


def write_samples_png(path: Path, bundle: Bundle, codes: torch.Tensor, n_per_class: int, n_grid: int) -> None:
    """Per class (row): 2 held-out reals, their 2 reconstructions, then n_grid AR samples."""
    held = load_digits_split("heldout", bundle.vq.config.image_size)
    codes = codes.reshape(bundle.target.config.num_classes, n_per_class, -1)
    real_u8 = ((held.images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    rows = []
    for c in range(bundle.target.config.num_classes):
        idx = torch.nonzero(held.labels == c).flatten()[:2]
        recon = bundle.decode_images(bundle.vq.encode(held.images[idx]))
        rows.append(list(real_u8[idx.numpy()]) + list(recon) + list(bundle.decode_images(codes[c, :n_grid])))
    save_image(sample_grid(rows), path, optimize=True)


def build_bundle(work: str | Path, out: str | Path, s: PipelineSettings, reports: dict, command: str,
                 threads: int, n_grid: int = 6) -> dict:
    """Pack `work`'s stage outputs into the bundle folder `out`, measure it, write config + manifest."""
    work, out = Path(work), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("vq", "evaluator", "target"):
        shutil.copyfile(work / f"{name}.safetensors", out / f"{name}.safetensors")
    bundle = work_bundle(work)
    target_hash = weights_hash(bundle.target.state_dict())
    save_file(load_file(str(work / "drafter.safetensors")), str(out / "drafter.safetensors"),
              metadata={"target_hash": target_hash})
    prox = build_proximity_table(bundle.vq.codebook_vectors(), k_max=bundle.vq.config.codebook_size - 1)
    save_file({"neighbours": prox.to(torch.int32).contiguous()}, str(out / "proximity.safetensors"))
    sampling = reports["sampling"]["chosen"]
    write_json(out / "config.json", {**bundle.config, "sampling": sampling})

    ev, codes = cached_evaluation(work, bundle, sampling, s.eval_per_class, seed=s.seed)
    write_samples_png(out / "samples.png", bundle, codes, s.eval_per_class, n_grid)

    base = reports["base"]["stages"]
    tok, tgt, dr = base["tokenizer"], reports["target"], reports["drafter"]
    metrics = {
        "vq_recon_mse": tok["recon_mse"], "vq_recon_l1": tok["recon_l1"], "vq_mean_image_mse": tok["mean_image_mse"],
        "vq_codes_used_heldout": tok["codes_used_heldout"],
        "target_heldout_ce": tgt["heldout_ce"], "target_heldout_top1_acc": tgt["heldout_top1_acc"],
        "target_mean_top1_prob": tgt["mean_top1_prob"],
        "drafter_top1_agreement_cond": dr["top1_agreement_cond"],
        "drafter_top1_agreement_uncond": dr["top1_agreement_uncond"],
        "drafter_top1_agreement_self_samples_cond": dr["self_samples_top1_agreement_cond"],
        "drafter_top1_agreement_self_samples_uncond": dr["self_samples_top1_agreement_uncond"],
        "evaluator_heldout_accuracy": base["evaluator"]["heldout_accuracy"],
        "ar_class_accuracy": ev["generated"]["class_accuracy"], "ar_frechet": ev["generated"]["frechet_distance"],
        "ar_per_class_accuracy": ev["generated"]["per_class_accuracy"],
        "real_class_accuracy": ev["real_train_reference"]["class_accuracy"],
        "real_frechet": ev["real_train_reference"]["frechet_distance"],
    }
    held = load_digits_split("heldout", 8)
    manifest = {
        "name": "lantern default: class-conditional digits",
        "command": command, "seed": s.seed, "torch_threads": threads, "torch": torch.__version__,
        "python": platform.python_version(),
        "data": {"source": SOURCE, "classes": "digits 0-9 (class id = digit)",
                 "image_size": bundle.vq.config.image_size,
                 "split": f"fixed per-class {HELD_OUT_FRACTION:.0%} held-out, SPLIT_SEED={SPLIT_SEED} "
                          f"(lantern.embedded.data.held_out_indices)",
                 "n_train": len(load_digits_split("train", 8).labels), "n_heldout": len(held.labels)},
        "base": {"command": reports["base"]["command"], "files": reports["base"]["files"],
                 "kept": "tokenizer (vq) and evaluator as they are; target grown",
                 "rebuild": "git archive fe25dc9 lantern/assets/default | tar -x -C BASE"},
        "growth": {"from_layers": s.gpt.n_layer // 2, "to_layers": s.gpt.n_layer,
                   "recipe": "base layer i -> layers 2i and 2i+1 (lantern.embedded.train.grow); the copy's "
                             f"{' and '.join(RESIDUAL_OUTPUTS)} zeroed, so training starts from the base function"},
        "settings": s.to_dict(),
        "stages": {k: v for k, v in reports.items() if k not in ("base", "reused_from")},
        "base_stages": base,
        "train_seconds": {"tokenizer (base)": tok["train_seconds"],
                          "evaluator (base)": base["evaluator"]["train_seconds"],
                          **{f"{k} (base)": v["train_seconds"] for k, v in base["target"].items()},
                          "target (grown)": tgt["train_seconds"], "drafter": dr["train_seconds"]},
        "drafter": {"target_hash": target_hash, "hash": "lantern.bundle.weights_hash of target.safetensors"},
        "metrics": metrics,
        "evaluation": ev,
    }
    if "reused_from" in reports:
        manifest["target_reused_from"] = reports["reused_from"]
    manifest["files"] = {f.name: sha256_file(f) for f in sorted(out.iterdir())
                         if f.is_file() and f.name != "manifest.json"}
    write_json(out / "manifest.json", manifest)
    return manifest
