"""Stage 3: the EAGLE-1 style drafter, teacher-forced on the frozen target's own features.

For a sequence x_0..x_{L-1} under condition c, the target gives hidden (B, P+L, D). Drafter input j is the
pair (hidden[P-1+j], x_j) at x_j's position P+j; its regression target is hidden[P+j] (the feature whose
logits predict x_{j+1}). The final pair has no target feature unless x_{L-1} is fed, so it is dropped.

The target is frozen, so its features are computed once for every training row (`feature_bank`) rather than in
every step: a step then costs only the drafter's own forward and backward.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from lantern.bundle import weights_hash
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT
from lantern.embedded.train.common import (Checkpoint, autocast, finished_report, lr_at, save_weights, seed_everything,
                                  set_lr, step_generator, write_json)
from lantern.embedded.train.tokens import read_metadata


@torch.no_grad()
def target_features(target: GPT, tokens: torch.Tensor, cond: torch.Tensor, bf16: bool) -> torch.Tensor:
    """tokens (B, L) -> hidden (B, P+L-1, D) float32 from the frozen target (last token not fed)."""
    with autocast(bf16):
        _, hidden = target.forward_full(tokens[:, :-1], cond)
    return hidden.float()


class FeatureBank(NamedTuple):
    """The drafter's training rows: each sequence under its class, then again under the null class (the
    CFG uncond rows), with the frozen target's features; weights are how often a step draws each row."""

    tokens: torch.Tensor  # (N, L) int64
    hidden: torch.Tensor  # (N, P+L-1, D) bfloat16
    weights: torch.Tensor  # (N,) float


def feature_bank(target: GPT, tokens: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, null_prob: float,
                 bf16: bool, cache: Path | None = None, batch: int = 64, progress: bool = True) -> FeatureBank:
    """tokens (M, L), labels (M,), weights (M,) -> 2M rows: every sequence under its class (weight w * (1 -
    null_prob)) and under the null class (w * null_prob), so a weighted draw sees the null class as often as
    class dropout would. Cached as `cache` (safetensors, with what made it as JSON metadata)."""
    key = json.dumps({"target_hash": weights_hash(target.state_dict()), "n": len(tokens), "null_prob": null_prob,
                      "bf16": bf16, "tokens_sum": int(tokens.sum()), "labels_sum": int(labels.sum()),
                      "weights_sum": float(weights.double().sum())}, sort_keys=True)
    if cache is not None and cache.exists() and read_metadata(cache).get("key") == key:
        stored = load_file(str(cache))
        return FeatureBank(stored["tokens"], stored["hidden"], stored["weights"])
    rows_tokens = torch.cat([tokens, tokens])
    conds = torch.cat([labels, torch.full_like(labels, target.config.null_class)])
    hidden = torch.empty(len(rows_tokens), target.config.cls_token_num + tokens.shape[1] - 1, target.config.dim,
                         dtype=torch.bfloat16)  # (2M, P+L-1, D)
    for i in tqdm(range(0, len(rows_tokens), batch), desc="target features", disable=not progress):
        hidden[i:i + batch] = target_features(target, rows_tokens[i:i + batch], conds[i:i + batch], bf16)
    bank = FeatureBank(rows_tokens, hidden, torch.cat([weights * (1 - null_prob), weights * null_prob]))
    if cache is not None:
        save_file({"tokens": bank.tokens.contiguous(), "hidden": bank.hidden, "weights": bank.weights.contiguous()},
                  str(cache), metadata={"key": key})
    return bank


def drafter_pass(drafter: Drafter, target: GPT, tokens: torch.Tensor, hidden: torch.Tensor,
                 noise: torch.Tensor | None = None):
    """-> (predicted features (B, L-1, D), true next features (B, L-1, D))."""
    P = target.config.cls_token_num
    L1 = tokens.shape[1] - 1
    feats = hidden[:, P - 1:P - 1 + L1]  # f_{j-1} paired with x_j, j = 0..L-2
    if noise is not None:
        feats = feats + noise
    positions = (P + torch.arange(L1)).expand(tokens.shape[0], -1)
    pred = drafter(target, tokens=tokens[:, :L1], features=feats, positions=positions)
    return pred.float(), hidden[:, P:P + L1]


def drafter_loss(drafter: Drafter, target: GPT, tokens: torch.Tensor, hidden: torch.Tensor,
                 g: torch.Generator, noise_scale: float = 0.1, ce_weight: float = 0.1) -> torch.Tensor:
    """EAGLE: SmoothL1(f^, f) + 0.1 * CE(softmax(head(f)) as soft targets, head(f^)); features get U(-a, a) noise."""
    shape = (tokens.shape[0], tokens.shape[1] - 1, hidden.shape[-1])
    noise = (torch.rand(shape, generator=g) * 2 - 1) * noise_scale if noise_scale else None
    pred, true = drafter_pass(drafter, target, tokens, hidden, noise)
    reg = F.smooth_l1_loss(pred, true)
    with torch.no_grad():
        p_true = target.head(true).softmax(-1)
    ce = -(p_true * target.head(pred).log_softmax(-1)).sum(-1).mean()
    return reg + ce_weight * ce


@torch.no_grad()
def drafter_report(drafter: Drafter, target: GPT, tokens: torch.Tensor, labels: torch.Tensor,
                   batch: int = 32, bf16: bool = True) -> dict:
    """Held-out, teacher-forced: how often argmax head(f^) equals the target's argmax head(f), per token,
    under the true class and under the null class (the CFG uncond row)."""
    drafter.eval()
    out = {}
    for name, use_null in (("cond", False), ("uncond", True)):
        agree, n = 0.0, 0
        for i in range(0, len(tokens), batch):
            x = tokens[i:i + batch]
            c = target.null_condition(len(x)) if use_null else labels[i:i + batch]
            hidden = target_features(target, x, c, bf16)
            with autocast(bf16):
                pred, true = drafter_pass(drafter, target, x, hidden)
            agree += float((target.head(pred.float()).argmax(-1) == target.head(true).argmax(-1)).sum())
            n += pred.shape[0] * pred.shape[1]
        out[f"top1_agreement_{name}"] = agree / n
    return out


def train_drafter(out_dir: str, target: GPT, tokens: torch.Tensor, labels: torch.Tensor,
                  heldout: tuple[torch.Tensor, torch.Tensor], steps: int = 600, batch: int = 32,
                  lr: float = 1e-3, null_prob: float = 0.1, seed: int = 0, bf16: bool = True,
                  ckpt_every: int = 50, progress: bool = True, sample_weights: torch.Tensor | None = None) -> dict:
    """-> `<out_dir>/drafter.safetensors`, `drafter_report.json`; resumes from `drafter.ckpt`.
    sample_weights (N,): how often each sequence is drawn (default: uniformly), e.g. to mix datasets."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(seed)
    target.eval().requires_grad_(False)
    drafter = Drafter(target.config)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    run_cfg = {"steps": steps, "batch": batch, "lr": lr, "null_prob": null_prob, "seed": seed, "bf16": bf16,
               "noise": "U(-0.1, 0.1)", "ce_weight": 0.1, "n_sequences": len(tokens),
               "target_hash": weights_hash(target.state_dict()),  # a checkpoint for another target is refused
               "weighted": sample_weights is not None, "features": "computed once (feature_bank), bf16"}
    ckpt = Checkpoint(out, "drafter")
    start, prior_seconds = ckpt.load(drafter, opt, run_cfg)
    done = finished_report(out, "drafter", start, steps, "drafter.safetensors")
    if done is not None:
        return done
    t0 = time.time()
    weights = torch.ones(len(tokens)) if sample_weights is None else sample_weights
    bank = feature_bank(target, tokens, labels, weights / weights.sum(), null_prob, bf16,
                        cache=out / "drafter_features.safetensors", progress=progress)
    bar = tqdm(range(start, steps), desc="drafter", disable=not progress, initial=start, total=steps)
    for step in bar:
        drafter.train()
        g = step_generator(seed, step)
        idx = torch.multinomial(bank.weights, batch, replacement=True, generator=g)
        set_lr(opt, lr_at(step, steps, lr, warmup=min(50, steps // 10 + 1)))
        with autocast(bf16):
            loss = drafter_loss(drafter, target, bank.tokens[idx], bank.hidden[idx].float(), g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.4f}")
        if (step + 1) % ckpt_every == 0 or step + 1 == steps:
            ckpt.save(drafter, opt, run_cfg, step + 1, prior_seconds + time.time() - t0)
    seconds = prior_seconds + time.time() - t0  # training wall time (features included), every resumed run
    report = drafter_report(drafter, target, *heldout, bf16=bf16)
    report.update(train_seconds=round(seconds, 1), run=run_cfg)
    save_weights(drafter, out / "drafter.safetensors")
    write_json(out / "drafter_report.json", report)
    return report
