"""Digit images -> VQ token sequences for the target and drafter stages (augmented copies for training)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lantern.embedded.data import augment, load_digits_split
from lantern.models.vq import VQModel


@torch.no_grad()
def encode_all(vq: VQModel, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """(N, 3, H, W) -> (N, h*w) int64 codes."""
    vq.eval()
    return torch.cat([vq.encode(images[i:i + batch]) for i in range(0, len(images), batch)])


def token_dataset(vq: VQModel, n_aug: int, seed: int, cache_dir: str | None = None) -> dict:
    """{'train': (tokens (N*n_aug, L), labels), 'heldout': (tokens (M, L), labels)}; copy 0 of every training
    image is un-augmented, copies 1..n_aug-1 are seeded affine jitters. Cached as `<cache_dir>/tokens.safetensors`
    (plain tensors, the dataset's key as JSON metadata: nothing in a cache can run code when it is read)."""
    if n_aug < 1:
        raise ValueError(f"n_aug {n_aug} must be >= 1")
    size = vq.config.image_size
    path = Path(cache_dir) / "tokens.safetensors" if cache_dir else None
    key = json.dumps({"n_aug": n_aug, "seed": seed, "size": size}, sort_keys=True)
    if path is not None and path.exists():
        cached = load_file(str(path))
        if read_metadata(path).get("key") == key:
            return {split: (cached[f"{split}_tokens"], cached[f"{split}_labels"]) for split in ("train", "heldout")}
    train, held = load_digits_split("train", size), load_digits_split("heldout", size)
    g = torch.Generator().manual_seed(seed)
    copies = [train.images] + [augment(train.images, g) for _ in range(n_aug - 1)]
    data = {
        "train": (encode_all(vq, torch.cat(copies)), train.labels.repeat(n_aug)),
        "heldout": (encode_all(vq, held.images), held.labels),
    }
    if path is not None:
        tensors = {f"{split}_{part}": t.contiguous() for split, (tokens, labels) in data.items()
                   for part, t in (("tokens", tokens), ("labels", labels))}
        save_file(tensors, str(path), metadata={"key": key})
    return data


def read_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata of a safetensors file (empty if it has none)."""
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}
