"""Digit images -> VQ token sequences for the target and drafter stages (augmented copies for training)."""
from __future__ import annotations

from pathlib import Path

import torch

from lantern.data import augment, load_digits_split
from lantern.models.vq import VQModel


@torch.no_grad()
def encode_all(vq: VQModel, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """(N, 3, H, W) -> (N, h*w) int64 codes."""
    vq.eval()
    return torch.cat([vq.encode(images[i:i + batch]) for i in range(0, len(images), batch)])


def token_dataset(vq: VQModel, n_aug: int, seed: int, cache_dir: str | None = None) -> dict:
    """{'train': (tokens (N*n_aug, L), labels), 'heldout': (tokens (M, L), labels)}; copy 0 of every training
    image is un-augmented, copies 1..n_aug-1 are seeded affine jitters. Cached as `<cache_dir>/tokens.pt`."""
    if n_aug < 1:
        raise ValueError(f"n_aug {n_aug} must be >= 1")
    size = vq.config.image_size
    path = Path(cache_dir) / "tokens.pt" if cache_dir else None
    key = {"n_aug": n_aug, "seed": seed, "size": size}
    if path is not None and path.exists():
        cached = torch.load(path, weights_only=False)
        if cached["key"] == key:
            return cached["data"]
    train, held = load_digits_split("train", size), load_digits_split("heldout", size)
    g = torch.Generator().manual_seed(seed)
    copies = [train.images] + [augment(train.images, g) for _ in range(n_aug - 1)]
    data = {
        "train": (encode_all(vq, torch.cat(copies)), train.labels.repeat(n_aug)),
        "heldout": (encode_all(vq, held.images), held.labels),
    }
    if path is not None:
        torch.save({"key": key, "data": data}, path)
    return data
