"""Stage 2: the class-conditional LlamaGen-architecture target, teacher-forced next-token cross-entropy."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from lantern.models.config import GPTConfig
from lantern.models.gpt import GPT
from lantern.embedded.train.common import (Checkpoint, autocast, finished_report, lr_at, save_weights, seed_everything,
                                  set_lr, step_generator, write_json)


def drop_classes(labels: torch.Tensor, prob: float, null_class: int, g: torch.Generator) -> torch.Tensor:
    """Replace each label by the null class with probability `prob` (trains the CFG unconditional row)."""
    drop = torch.rand(labels.shape, generator=g) < prob
    return torch.where(drop, torch.full_like(labels, null_class), labels)


def target_loss(model: GPT, tokens: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """Mean CE of image tokens (B, L) given the condition; the last token is never fed (nothing to predict)."""
    P = model.config.cls_token_num
    logits, _ = model.forward_full(tokens[:, :-1], cond)  # (B, P + L - 1, V)
    return F.cross_entropy(logits[:, P - 1:].reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))


@torch.no_grad()
def target_report(model: GPT, tokens: torch.Tensor, labels: torch.Tensor, batch: int = 32,
                  bf16: bool = True) -> dict:
    """Held-out teacher-forced figures under the true class (no CFG): CE, top-1 accuracy and the mean
    top-1 probability (how peaked the target's next-token distribution is; low means hard to draft)."""
    model.eval()
    P = model.config.cls_token_num
    ce, acc, top1p, n = 0.0, 0.0, 0.0, 0
    for i in range(0, len(tokens), batch):
        x, c = tokens[i:i + batch], labels[i:i + batch]
        with autocast(bf16):
            logits, _ = model.forward_full(x[:, :-1], c)
        logits = logits[:, P - 1:].float()  # (b, L, V)
        prob = logits.softmax(-1)
        ce += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1), reduction="sum"))
        acc += float((logits.argmax(-1) == x).sum())
        top1p += float(prob.max(-1).values.sum())
        n += x.numel()
    return {"heldout_ce": ce / n, "heldout_top1_acc": acc / n, "mean_top1_prob": top1p / n}


def train_target(out_dir: str, cfg: GPTConfig, tokens: torch.Tensor, labels: torch.Tensor,
                 heldout: tuple[torch.Tensor, torch.Tensor], steps: int = 1200, batch: int = 32,
                 lr: float = 8e-4, weight_decay: float = 0.05, seed: int = 0, bf16: bool = True,
                 ckpt_every: int = 50, progress: bool = True, init_from: str | None = None,
                 name: str = "target") -> dict:
    """tokens (N, L) int64, labels (N,) -> `<out_dir>/<name>.safetensors`, `<name>_config.json`,
    `<name>_report.json`; resumes from `<name>.ckpt`. init_from: weights to continue from (a second phase
    with its own warm-up and decay) instead of a fresh init."""
    if tokens.shape[1] != cfg.block_size:
        raise ValueError(f"token sequences of length {tokens.shape[1]}; config block_size is {cfg.block_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(seed)
    model = GPT(cfg)
    if init_from is not None:
        model.load_state_dict(load_file(init_from))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    run_cfg = {"gpt": cfg.to_dict(), "steps": steps, "batch": batch, "lr": lr, "weight_decay": weight_decay,
               "seed": seed, "bf16": bf16, "n_sequences": len(tokens)}
    if init_from is not None:
        run_cfg["init_from"] = Path(init_from).name
    ckpt = Checkpoint(out, name)
    start, prior_seconds = ckpt.load(model, opt, run_cfg)
    done = finished_report(out, name, start, steps, f"{name}.safetensors")
    if done is not None:
        return done
    t0, last_loss = time.time(), None
    bar = tqdm(range(start, steps), desc="target", disable=not progress, initial=start, total=steps)
    for step in bar:
        model.train()
        g = step_generator(seed, step)
        idx = torch.randint(0, len(tokens), (batch,), generator=g)
        cond = drop_classes(labels[idx], cfg.class_dropout_prob, cfg.null_class, g)
        set_lr(opt, lr_at(step, steps, lr, warmup=min(100, steps // 10 + 1)))
        with autocast(bf16):
            loss = target_loss(model, tokens[idx], cond)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last_loss = loss.item()
        bar.set_postfix(loss=f"{last_loss:.3f}")
        if (step + 1) % ckpt_every == 0 or step + 1 == steps:
            ckpt.save(model, opt, run_cfg, step + 1, prior_seconds + time.time() - t0)
    seconds = prior_seconds + time.time() - t0  # training wall time, every resumed run included
    report = target_report(model, *heldout, bf16=bf16)
    report.update(train_seconds=round(seconds, 1), final_train_loss=last_loss, run=run_cfg)
    save_weights(model, out / f"{name}.safetensors")
    write_json(out / f"{name}_config.json", cfg.to_dict())
    write_json(out / f"{name}_report.json", report)
    return report
