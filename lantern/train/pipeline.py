"""The whole pipeline behind a bundle: train every stage (resumable), measure, and pack the bundle folder."""
from __future__ import annotations

import json
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from lantern.bundle import load_bundle, sha256_file, weights_hash
from lantern.config import GPTConfig
from lantern.data import HELD_OUT_FRACTION, SOURCE, SPLIT_SEED, load_digits_split
from lantern.evaluate import evaluate
from lantern.kv_cache import StaticKVCache
from lantern.models.classifier import ClassifierConfig
from lantern.models.gpt import GPT
from lantern.models.vq import VQConfig, VQModel
from lantern.proximity import build_proximity_table
from lantern.train.common import write_json
from lantern.train.drafter import train_drafter
from lantern.train.evaluator import train_evaluator
from lantern.train.sample import sample_ar_simple
from lantern.train.target import train_target
from lantern.train.tokenizer import train_tokenizer
from lantern.train.tokens import token_dataset


@dataclass(frozen=True)
class PipelineSettings:
    seed: int
    vq: VQConfig
    vq_steps: int
    vq_batch: int
    vq_lr: float
    gpt: GPTConfig
    n_aug: int
    target_steps: int
    target_batch: int
    target_lr: float
    target2_steps: int  # a second phase continuing from the first one's weights (0 = none)
    target2_lr: float
    drafter_steps: int
    drafter_batch: int
    drafter_lr: float
    evaluator: ClassifierConfig
    evaluator_steps: int
    evaluator_batch: int
    cfg_scale: float
    temperature: float
    top_k: int
    eval_per_class: int

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in d.items()}


def load_vq(work: Path) -> VQModel:
    vq = VQModel(VQConfig.from_dict(json.loads((work / "vq_config.json").read_text())))
    vq.load_state_dict(load_file(str(work / "vq.safetensors")))
    return vq.eval()


def load_target(work: Path, name: str = "target") -> GPT:
    target = GPT(GPTConfig.from_dict(json.loads((work / f"{name}_config.json").read_text())))
    target.load_state_dict(load_file(str(work / f"{name}.safetensors")))
    return target.eval()


def run_pipeline(work: str | Path, s: PipelineSettings, progress: bool = True) -> dict:
    """Train tokenizer -> target -> drafter, and the evaluator, into `work`; returns each stage's report."""
    work = Path(work)
    reports = {"tokenizer": train_tokenizer(work, s.vq, steps=s.vq_steps, batch=s.vq_batch, lr=s.vq_lr,
                                            seed=s.seed, restart_every=50, ckpt_every=50, progress=progress)}
    vq = load_vq(work)
    data = token_dataset(vq, s.n_aug, s.seed, cache_dir=str(work))
    reports["target"] = train_target(work, s.gpt, *data["train"], data["heldout"], steps=s.target_steps,
                                     batch=s.target_batch, lr=s.target_lr, seed=s.seed, progress=progress)
    if s.target2_steps:
        reports["target_phase1"] = reports["target"]
        reports["target"] = train_target(work, s.gpt, *data["train"], data["heldout"], steps=s.target2_steps,
                                         batch=s.target_batch, lr=s.target2_lr, seed=s.seed + 1, progress=progress,
                                         init_from=str(work / "target.safetensors"), name="target2")
    target = load_target(work, final_target_name(s))
    reports["drafter"] = train_drafter(work, target, *data["train"], data["heldout"], steps=s.drafter_steps,
                                       batch=s.drafter_batch, lr=s.drafter_lr, seed=s.seed, progress=progress)
    reports["evaluator"] = train_evaluator(work, s.evaluator, steps=s.evaluator_steps, batch=s.evaluator_batch,
                                           seed=s.seed, progress=progress)
    return reports


def final_target_name(s: PipelineSettings) -> str:
    return "target2" if s.target2_steps else "target"


@torch.no_grad()
def decode_step_ms(target: GPT, batch: int = 2, reps: int = 30) -> float:
    """Median wall time of one AR decode step (1 token per row, mid-image, over the static KV cache)."""
    cfg = target.config
    S = cfg.seq_len
    cache = StaticKVCache(cfg.n_layer, batch, S, cfg.kv_heads, cfg.head_dim, torch.float32, "cpu")
    pos = torch.full((batch, 1), S // 2)
    mask = (torch.arange(S) <= S // 2).expand(batch, 1, -1)
    h = target.tok_embeddings(torch.zeros(batch, 1, dtype=torch.long))
    times = []
    for _ in range(reps + 5):
        t = time.perf_counter()
        target.head(target.forward_cached(h, pos, mask, cache, pos))
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times[5:]))


def sample_grid(rows: list[list[np.ndarray]], scale: int = 2) -> Image.Image:
    """rows of (H, W, 3) uint8 images -> one PNG-ready grid, each tile upscaled by `scale` (nearest)."""
    grid = np.concatenate([np.concatenate(r, axis=1) for r in rows], axis=0)
    img = Image.fromarray(grid)
    return img.resize((img.width * scale, img.height * scale), Image.NEAREST)


def build_bundle(work: str | Path, out: str | Path, s: PipelineSettings, reports: dict, command: str,
                 threads: int, n_grid: int = 6) -> dict:
    """Pack `work`'s stage outputs into the bundle folder `out`, measure it, write config + manifest."""
    work, out = Path(work), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("vq", "evaluator"):
        shutil.copyfile(work / f"{name}.safetensors", out / f"{name}.safetensors")
    shutil.copyfile(work / f"{final_target_name(s)}.safetensors", out / "target.safetensors")
    target = load_target(work, final_target_name(s))
    target_hash = weights_hash(target.state_dict())
    drafter_state = load_file(str(work / "drafter.safetensors"))
    save_file(drafter_state, str(out / "drafter.safetensors"), metadata={"target_hash": target_hash})
    vq = load_vq(work)
    prox = build_proximity_table(vq.codebook_vectors(), k_max=vq.config.codebook_size - 1)
    save_file({"neighbours": prox.to(torch.int32).contiguous()}, str(out / "proximity.safetensors"))
    sampling = {"cfg_scale": s.cfg_scale, "temperature": s.temperature, "top_k": s.top_k}
    write_json(out / "config.json", {"vq": s.vq.to_dict(), "target": s.gpt.to_dict(),
                                     "evaluator": s.evaluator.to_dict(), "sampling": sampling})
    bundle = load_bundle(out, verify=False)

    generated: list[torch.Tensor] = []

    def generate_fn(class_ids: torch.Tensor, seed: int) -> torch.Tensor:
        codes = sample_ar_simple(bundle.target, class_ids, s.cfg_scale, s.temperature, s.top_k, seed)
        generated.append(codes)
        return codes

    t0 = time.time()
    ev = evaluate(bundle, generate_fn, n_per_class=s.eval_per_class, seed=s.seed)
    ar_seconds = time.time() - t0

    # samples.png: per class (row) 2 held-out reals, their 2 reconstructions, then n_grid AR samples
    held = load_digits_split("heldout", s.vq.image_size)
    codes = torch.cat(generated).reshape(bundle.target.config.num_classes, s.eval_per_class, -1)
    real_u8 = ((held.images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    rows = []
    for c in range(bundle.target.config.num_classes):
        idx = torch.nonzero(held.labels == c).flatten()[:2]
        recon = bundle.decode_images(vq.encode(held.images[idx]))
        samples = bundle.decode_images(codes[c, :n_grid])
        rows.append(list(real_u8[idx.numpy()]) + list(recon) + list(samples))
    sample_grid(rows).save(out / "samples.png", optimize=True)

    tok, tgt, dr, evr = (reports[k] for k in ("tokenizer", "target", "drafter", "evaluator"))
    metrics = {
        "vq_recon_mse": tok["recon_mse"], "vq_recon_l1": tok["recon_l1"], "vq_mean_image_mse": tok["mean_image_mse"],
        "vq_codes_used_heldout": tok["codes_used_heldout"],
        "target_heldout_ce": tgt["heldout_ce"], "target_heldout_top1_acc": tgt["heldout_top1_acc"],
        "target_mean_top1_prob": tgt["mean_top1_prob"], "target_step_ms_batch2": decode_step_ms(bundle.target),
        "drafter_top1_agreement_cond": dr["top1_agreement_cond"],
        "drafter_top1_agreement_uncond": dr["top1_agreement_uncond"],
        "evaluator_heldout_accuracy": evr["heldout_accuracy"],
        "ar_class_accuracy": ev["generated"]["class_accuracy"], "ar_frechet": ev["generated"]["frechet_distance"],
        "real_class_accuracy": ev["real_train_reference"]["class_accuracy"],
        "real_frechet": ev["real_train_reference"]["frechet_distance"],
        "ar_eval_seconds": round(ar_seconds, 1),
    }
    n_train, n_held = len(load_digits_split("train", 8).labels), len(held.labels)
    manifest = {
        "name": "lantern default: class-conditional digits",
        "command": command, "seed": s.seed, "torch_threads": threads, "torch": torch.__version__,
        "python": platform.python_version(),
        "data": {"source": SOURCE, "classes": "digits 0-9 (class id = digit)", "image_size": s.vq.image_size,
                 "split": f"fixed per-class {HELD_OUT_FRACTION:.0%} held-out, SPLIT_SEED={SPLIT_SEED} "
                          f"(lantern.data.held_out_indices)", "n_train": n_train, "n_heldout": n_held},
        "settings": s.to_dict(),
        "stages": reports,
        "drafter": {"target_hash": target_hash, "hash": "lantern.bundle.weights_hash of target.safetensors"},
        "metrics": metrics,
        "evaluation": ev,
    }
    manifest["files"] = {f.name: sha256_file(f) for f in sorted(out.iterdir())
                         if f.is_file() and f.name != "manifest.json"}
    write_json(out / "manifest.json", manifest)
    return manifest
