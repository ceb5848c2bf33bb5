"""Stage 4: the evaluator, a small CNN classifier on augmented real digit images."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lantern.embedded.data import augment, load_digits_split
from lantern.models.classifier import Classifier, ClassifierConfig
from lantern.embedded.train.common import (Checkpoint, autocast, lr_at, save_weights, seed_everything, set_lr,
                                  step_generator, write_json)


def train_evaluator(out_dir: str, cfg: ClassifierConfig = ClassifierConfig(), steps: int = 400, batch: int = 64,
                    lr: float = 2e-3, seed: int = 0, bf16: bool = True, ckpt_every: int = 100,
                    progress: bool = True) -> dict:
    """-> `<out_dir>/evaluator.safetensors`, `evaluator_config.json`, `evaluator_report.json`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(seed)
    train = load_digits_split("train", cfg.image_size)
    held = load_digits_split("heldout", cfg.image_size)
    model = Classifier(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    run_cfg = {"classifier": cfg.to_dict(), "steps": steps, "batch": batch, "lr": lr, "seed": seed, "bf16": bf16}
    ckpt = Checkpoint(out, "evaluator")
    start, prior_seconds = ckpt.load(model, opt, run_cfg)
    t0 = time.time()
    bar = tqdm(range(start, steps), desc="evaluator", disable=not progress, initial=start, total=steps)
    for step in bar:
        model.train()
        g = step_generator(seed, step)
        idx = torch.randint(0, len(train.images), (batch,), generator=g)
        x = augment(train.images[idx], g)
        set_lr(opt, lr_at(step, steps, lr, warmup=min(50, steps // 10 + 1)))
        with autocast(bf16):
            loss = F.cross_entropy(model(x).float(), train.labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % ckpt_every == 0 or step + 1 == steps:
            ckpt.save(model, opt, run_cfg, step + 1, prior_seconds + time.time() - t0)
    seconds = prior_seconds + time.time() - t0  # training wall time, every resumed run included
    pred, _ = model.predict(held.images)
    report = {"heldout_accuracy": float((pred == held.labels).float().mean()), "n_heldout": len(held.labels),
              "train_seconds": round(seconds, 1), "run": run_cfg}
    save_weights(model, out / "evaluator.safetensors")
    write_json(out / "evaluator_config.json", cfg.to_dict())
    write_json(out / "evaluator_report.json", report)
    return report
