"""The target's own samples, drawn through the product's Pipeline (batched AR, backend cpu, fp32): for
evaluating a target while it is built, and as the drafter's self-distillation data (the EAGLE recipe)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from lantern.api import Pipeline
from lantern.decoding import SamplingConfig, method_preset
from lantern.embedded.evaluate import GenerateFn
from lantern.models.checkpoint import weights_hash
from lantern.models.gpt import GPT
from lantern.embedded.train.tokens import read_metadata


def ar_sampler(target: GPT, sampling: dict) -> GenerateFn:
    """(class_ids (n,), seed) -> codes (n, block_size): all n images in one AR batch."""
    pipe = Pipeline(target, backend="cpu", dtype="fp32")
    dcfg = method_preset("ar", SamplingConfig(**sampling))

    def generate(class_ids: torch.Tensor, seed: int) -> torch.Tensor:
        return pipe.generate([int(c) for c in class_ids], dcfg, seed=seed).tokens

    return generate


def self_sample_chunk(work: str | Path, target: GPT, sampling: dict, per_class: int, index: int, seed: int,
                      target_hash: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk `index`: one AR batch with `per_class` images of every class, sampled with seed + index, cached as
    `<work>/self_samples/chunk_<index>.safetensors` with what made it as JSON metadata (a changed target or
    setting resamples) -> tokens (n, block_size), labels (n,)."""
    folder = Path(work) / "self_samples"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"chunk_{index:03d}.safetensors"
    class_ids = torch.arange(target.config.num_classes).repeat_interleave(per_class)
    key = json.dumps({"sampling": sampling, "seed": seed + index, "classes": class_ids.tolist(),
                      "target_hash": target_hash or weights_hash(target.state_dict())}, sort_keys=True)
    if not path.exists() or read_metadata(path).get("key") != key:
        tokens = ar_sampler(target, sampling)(class_ids, seed + index)
        save_file({"tokens": tokens.contiguous(), "labels": class_ids.contiguous()}, str(path),
                  metadata={"key": key})
    chunk = load_file(str(path))
    return chunk["tokens"], chunk["labels"]


def self_samples(work: str | Path, target: GPT, sampling: dict, per_class_per_chunk: int, chunks: int, seed: int,
                 progress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks 0..chunks-1 (see self_sample_chunk), concatenated: tokens (N, block_size), labels (N,)."""
    target_hash = weights_hash(target.state_dict())
    parts = [self_sample_chunk(work, target, sampling, per_class_per_chunk, i, seed, target_hash)
             for i in tqdm(range(chunks), desc="self-samples", disable=not progress)]
    return torch.cat([tokens for tokens, _ in parts]), torch.cat([labels for _, labels in parts])
