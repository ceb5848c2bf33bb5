"""Writing images: any one image atomically, and generated images as one PNG each and a labelled grid."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import psutil
from PIL import Image

from lantern.files.atomic_io import atomic_path, check_fits, remove_stale

GRID_PAD = 2  # white gutter between a grid's images, in pixels before upscaling


def save_image(image: Image.Image, path: str | os.PathLike, **options) -> None:
    """A PIL image to `path`, atomically, in the format its suffix names (.png, .jpg, ...)."""
    path = Path(path)
    fmt = Image.registered_extensions().get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path}: unknown image format {path.suffix!r}")
    with atomic_path(path) as tmp:
        image.save(tmp, format=fmt, **options)


def make_grid(images: np.ndarray, cols: int | None = None, pad: int = GRID_PAD) -> np.ndarray:
    """(n, H, W, 3) uint8 -> one (rows*(H+pad)+pad, cols*(W+pad)+pad, 3) uint8 image, white gutters."""
    n, h, w, c = images.shape
    rows, cols = grid_shape(n, cols)
    grid = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, c), 255, dtype=np.uint8)
    for i, img in enumerate(images):
        r, col = divmod(i, cols)
        y, x = pad + r * (h + pad), pad + col * (w + pad)
        grid[y:y + h, x:x + w] = img
    return grid


def grid_shape(n: int, cols: int | None = None) -> tuple[int, int]:
    cols = cols or min(n, 8)
    return -(-n // cols), cols


def check_outputs(out_dir: Path, names: Sequence[str], size: int, scale: int, grid_cols: int | None = None) -> None:
    """Before any work: refuse (ValueError naming the flag) output names the filesystem cannot take (--out) and a
    --scale whose largest image, the grid of `len(names)` images of size x size, cannot be held in memory."""
    for name in [*names, "grid"]:
        check_fits(Path(out_dir) / f"{name}.png", "--out")
    rows, cols = grid_shape(len(names), grid_cols)
    pixels = (rows * (size + GRID_PAD) + GRID_PAD) * (cols * (size + GRID_PAD) + GRID_PAD)
    need = 2 * 3 * pixels * scale ** 2  # the upscaled grid and PNG encoding's copy of it, 3 bytes a pixel
    available = psutil.virtual_memory().available
    side = max(rows, cols) * (size + GRID_PAD) * scale
    if need > available or side >= 2 ** 31:
        largest = max(1, min(int((available / (2 * 3 * pixels)) ** 0.5), (2 ** 31 - 1) // (side // scale)))
        raise ValueError(f"--scale {scale} makes a grid of {need / 2**30:.3g} GiB ({side} pixels a side); this "
                         f"machine has {available / 2**30:.3g} GiB available; allowed: --scale <= {largest}")


def save_images(images: np.ndarray, out_dir: Path, names: Sequence[str], grid_cols: int | None = None,
                scale: int = 1) -> tuple[list[str], str]:
    """Write each image and a grid (nearest-neighbour upscaled by `scale`), each atomically (a reader, or a run
    stopped mid-write, never sees half a PNG); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale(out_dir)
    paths = []
    for img, name in zip(images, names):
        p = out_dir / f"{name}.png"
        save_image(_upscaled(img, scale), p)
        paths.append(str(p))
    grid_path = out_dir / "grid.png"
    save_image(_upscaled(make_grid(images, grid_cols), scale), grid_path)
    return paths, str(grid_path)


def _upscaled(img: np.ndarray, scale: int) -> Image.Image:
    im = Image.fromarray(img)
    return im.resize((im.width * scale, im.height * scale), Image.NEAREST) if scale > 1 else im
