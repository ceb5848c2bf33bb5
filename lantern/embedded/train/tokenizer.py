"""Stage 1: the VQ tokenizer, trained on augmented digit images with reconstruction + codebook + commitment."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lantern.embedded.data import augment, load_digits_split
from lantern.models.vq import VQConfig, VQModel
from lantern.embedded.train.common import (Checkpoint, autocast, lr_at, save_weights, seed_everything, set_lr,
                                  step_generator, write_json)


def _restart_dead_codes(vq: VQModel, latents: torch.Tensor, counts: torch.Tensor, g: torch.Generator) -> int:
    """Re-seed codes no latent picked since the last restart at random recent encoder outputs
    (keeps the codebook in use; LlamaGen gets there with scale instead). Returns how many were reset."""
    dead = torch.nonzero(counts == 0).flatten()
    if len(dead):
        pick = torch.randint(0, latents.shape[0], (len(dead),), generator=g)
        with torch.no_grad():
            vq.quantize.embedding.weight[dead] = F.normalize(latents[pick], dim=-1)
    return len(dead)


@torch.no_grad()
def reconstruction_report(vq: VQModel, images: torch.Tensor, batch: int = 128) -> dict:
    """Held-out MSE and L1 of decode(encode(x)) in [-1, 1] units, against the mean-image baseline."""
    vq.eval()
    recon = torch.cat([vq.decode_code(vq.encode(images[i:i + batch])) for i in range(0, len(images), batch)])
    codes = torch.cat([vq.encode(images[i:i + batch]) for i in range(0, len(images), batch)])
    mean_img = images.mean(0, keepdim=True)
    return {
        "recon_mse": float(F.mse_loss(recon, images)),
        "recon_l1": float((recon - images).abs().mean()),
        "mean_image_mse": float(F.mse_loss(mean_img.expand_as(images), images)),
        "codes_used_heldout": int(codes.unique().numel()),
    }


def train_tokenizer(out_dir: str, cfg: VQConfig = VQConfig(), steps: int = 800, batch: int = 32,
                    lr: float = 2e-3, seed: int = 0, bf16: bool = True, restart_every: int = 50,
                    ckpt_every: int = 100, progress: bool = True) -> dict:
    """Writes `<out_dir>/vq.safetensors`, `vq_config.json`, `vq_report.json`; resumes from `vq.ckpt`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(seed)
    train = load_digits_split("train", cfg.image_size)
    held = load_digits_split("heldout", cfg.image_size)
    vq = VQModel(cfg)
    opt = torch.optim.AdamW(vq.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    run_cfg = {"vq": cfg.to_dict(), "steps": steps, "batch": batch, "lr": lr, "seed": seed, "bf16": bf16,
               "restart_every": restart_every}
    ckpt = Checkpoint(out, "vq")
    start, prior_seconds = ckpt.load(vq, opt, run_cfg)
    counts = torch.zeros(cfg.codebook_size, dtype=torch.long)
    recent = []
    t0 = time.time()
    bar = tqdm(range(start, steps), desc="tokenizer", disable=not progress, initial=start, total=steps)
    for step in bar:
        vq.train()
        g = step_generator(seed, step)
        x = augment(train.images[torch.randint(0, len(train.images), (batch,), generator=g)], g)
        set_lr(opt, lr_at(step, steps, lr, warmup=min(50, steps // 10 + 1)))
        with autocast(bf16):
            z = vq.encode_latent(x)
        zq, codes, cb_loss, commit = vq.quantize_latent(z.float())
        with autocast(bf16):
            recon = vq.decode_latent(zq).float()
        rec = F.mse_loss(recon, x) + (recon - x).abs().mean()
        loss = rec + cb_loss + commit
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        counts += torch.bincount(codes.flatten(), minlength=cfg.codebook_size)
        recent.append(z.detach().float().permute(0, 2, 3, 1).reshape(-1, cfg.codebook_embed_dim))
        # restart dead codes in the first 60% of training only, so the codebook settles before the end
        if restart_every and (step + 1) % restart_every == 0 and step < 0.6 * steps:
            _restart_dead_codes(vq, torch.cat(recent), counts, g)
            counts.zero_()
            recent.clear()
        elif len(recent) > restart_every:
            recent.pop(0)
        bar.set_postfix(rec=f"{rec.item():.4f}", used=int((counts > 0).sum()))
        if (step + 1) % ckpt_every == 0 or step + 1 == steps:
            ckpt.save(vq, opt, run_cfg, step + 1, prior_seconds + time.time() - t0)
    seconds = prior_seconds + time.time() - t0  # training wall time, every resumed run included
    vq.eval()
    report = reconstruction_report(vq, held.images)
    report.update(train_seconds=round(seconds, 1), run=run_cfg)
    save_weights(vq, out / "vq.safetensors")
    write_json(out / "vq_config.json", cfg.to_dict())
    write_json(out / "vq_report.json", report)
    return report
