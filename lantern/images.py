"""Writing generated images: one PNG each and a labelled grid."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image


def make_grid(images: np.ndarray, cols: int | None = None, pad: int = 2) -> np.ndarray:
    """(n, H, W, 3) uint8 -> one (rows*(H+pad)+pad, cols*(W+pad)+pad, 3) uint8 image, white gutters."""
    n, h, w, c = images.shape
    cols = cols or min(n, 8)
    rows = -(-n // cols)
    grid = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, c), 255, dtype=np.uint8)
    for i, img in enumerate(images):
        r, col = divmod(i, cols)
        y, x = pad + r * (h + pad), pad + col * (w + pad)
        grid[y:y + h, x:x + w] = img
    return grid


def save_images(images: np.ndarray, out_dir: Path, names: Sequence[str], grid_cols: int | None = None,
                scale: int = 1) -> tuple[list[str], str]:
    """Write each image and a grid (nearest-neighbour upscaled by `scale`); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for img, name in zip(images, names):
        p = out_dir / f"{name}.png"
        _upscaled(img, scale).save(p)
        paths.append(str(p))
    grid_path = out_dir / "grid.png"
    _upscaled(make_grid(images, grid_cols), scale).save(grid_path)
    return paths, str(grid_path)


def _upscaled(img: np.ndarray, scale: int) -> Image.Image:
    im = Image.fromarray(img)
    return im.resize((im.width * scale, im.height * scale), Image.NEAREST) if scale > 1 else im
