"""The embedded model's data: scikit-learn's bundled hand-written digits, upsampled to small RGB images.

Provenance: `sklearn.datasets.load_digits()` reads a copy that ships inside the scikit-learn wheel
(sklearn/datasets/data/digits.csv.gz) of the test set of the UCI "Optical Recognition of Handwritten
Digits" data (Alpaydin & Kaynak, 1998): 1797 images of 8x8 pixels, 17 grey levels (0..16), 10 classes
(the digits 0..9), written by 43 people. Nothing is downloaded.

Images: ink level / 16 -> bicubic upsampling to `size` x `size` (smooth strokes instead of 8x8 blocks),
white ink on black, copied to 3 channels, scaled to [-1, 1]. Split: a fixed, seeded, per-class 20%
held-out set (`SPLIT_SEED`), independent of every training seed, so evaluation never sees training images.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lantern.extras import require

NUM_CLASSES = 10
SPLIT_SEED = 20250101
HELD_OUT_FRACTION = 0.2
SOURCE = "sklearn.datasets.load_digits (UCI optical digits test set, bundled with scikit-learn)"


@dataclass(frozen=True)
class DigitsSplit:
    images: torch.Tensor  # (N, 3, size, size) float32 in [-1, 1]
    labels: torch.Tensor  # (N,) int64 in [0, 10)
    indices: torch.Tensor  # (N,) int64 row ids into load_digits(), for provenance


def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
    require("sklearn", "the embedded digits data (lantern.embedded.data)")
    from sklearn.datasets import load_digits  # the eval and train extras, required above
    d = load_digits()
    return d.images.astype(np.float32), d.target.astype(np.int64)  # (1797, 8, 8) in 0..16, (1797,)


def upsample(raw: torch.Tensor, size: int) -> torch.Tensor:
    """(N, 8, 8) ink levels 0..16 -> (N, 3, size, size) in [-1, 1]."""
    x = (raw / 16.0)[:, None]  # (N, 1, 8, 8) in [0, 1]
    x = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False).clamp(0, 1)
    return (x * 2 - 1).expand(-1, 3, -1, -1).contiguous()


def held_out_indices(labels: np.ndarray) -> np.ndarray:
    """Fixed per-class held-out rows: the first 20% of each class under a permutation seeded by SPLIT_SEED."""
    rng = np.random.default_rng(SPLIT_SEED)
    held = []
    for c in range(NUM_CLASSES):
        rows = np.flatnonzero(labels == c)
        held.append(rng.permutation(rows)[: int(round(HELD_OUT_FRACTION * len(rows)))])
    return np.sort(np.concatenate(held))


def load_digits_split(split: str, size: int = 32) -> DigitsSplit:
    """split 'train' or 'heldout' -> images (N, 3, size, size) in [-1, 1], labels (N,)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split {split!r} is not one of 'train', 'heldout'")
    if size < 8:
        raise ValueError(f"size {size} must be >= 8 (the source images are 8x8)")
    raw, labels = _raw_digits()
    held = held_out_indices(labels)
    mask = np.zeros(len(labels), dtype=bool)
    mask[held] = True
    rows = np.flatnonzero(mask if split == "heldout" else ~mask)
    images = upsample(torch.from_numpy(raw[rows]), size)
    return DigitsSplit(images, torch.from_numpy(labels[rows]), torch.from_numpy(rows))


def augment(images: torch.Tensor, generator: torch.Generator, max_shift: float = 0.08,
            max_rot_deg: float = 8.0, scale_range: tuple[float, float] = (0.9, 1.1)) -> torch.Tensor:
    """Random small affine jitter (shift, rotation, scale) per image; background stays at -1.
    images (B, 3, H, W) in [-1, 1]; max_shift as a fraction of the half-width ([-1, 1] grid units)."""
    B = images.shape[0]
    u = torch.rand(B, 4, generator=generator) * 2 - 1  # (B, 4) in [-1, 1)
    angle = u[:, 0] * math.radians(max_rot_deg)
    lo, hi = scale_range
    scale = lo + (u[:, 1] + 1) / 2 * (hi - lo)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, u[:, 2] * max_shift], 1),
                         torch.stack([sin, cos, u[:, 3] * max_shift], 1)], 1)  # (B, 2, 3)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    # sample the image shifted to [0, 2] so zero padding outside the frame means background (-1)
    out = F.grid_sample(images + 1, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out - 1
