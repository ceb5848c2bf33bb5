"""`lantern eval`: sample quality of a bundle's generator, measured by the bundle's evaluator.

Reports class accuracy of generated images and their Frechet distance to held-out real images in the
evaluator's penultimate feature space, next to the same figures for real images as the reference floor.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from lantern.bundle import Bundle
from lantern.embedded.data import load_digits_split
from lantern.embedded.metrics import class_accuracy, frechet_distance

GenerateFn = Callable[[torch.Tensor, int], torch.Tensor]  # (class_ids (n,), seed) -> codes (n, h*w)


def _to_unit(images_uint8: np.ndarray) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float in [-1, 1], the evaluator's input."""
    return torch.from_numpy(images_uint8).permute(0, 3, 1, 2).float() / 127.5 - 1


def _figures(bundle: Bundle, images: torch.Tensor, labels: torch.Tensor, ref_feats: np.ndarray) -> dict:
    pred, feats = bundle.evaluator.predict(images)
    per_class = {int(c): class_accuracy(pred[labels == c].numpy(), labels[labels == c].numpy())
                 for c in labels.unique()}
    return {"class_accuracy": class_accuracy(pred.numpy(), labels.numpy()),
            "frechet_distance": frechet_distance(feats.numpy(), ref_feats),
            "per_class_accuracy": per_class, "n": len(labels)}


EVAL_CHUNK = 50  # images per generate_fn call by default (each chunk its own seed)


def evaluate(bundle: Bundle, generate_fn: GenerateFn, classes: Optional[Sequence[int]] = None,
             n_per_class: int = 10, seed: int = 0, batch_size: int = EVAL_CHUNK) -> dict:
    """Generate n_per_class images for each class (all classes if None) via generate_fn, in chunks of at
    most batch_size (chunk i gets seed + i), and score them against the held-out real images. JSON-able."""
    if bundle.evaluator is None:
        raise ValueError(f"bundle {bundle.path} has no evaluator.safetensors; `lantern eval` needs one")
    num_classes = bundle.target.config.num_classes
    classes = list(range(num_classes)) if classes is None else [int(c) for c in classes]
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad or not classes:
        raise ValueError(f"classes {bad or classes} not allowed; choose ids in [0, {num_classes})")
    if n_per_class < 1 or batch_size < 1:
        raise ValueError(f"n_per_class {n_per_class} and batch_size {batch_size} must be >= 1")

    size = bundle.vq.config.image_size
    held = load_digits_split("heldout", size)
    _, ref_feats = bundle.evaluator.predict(held.images)
    ref_feats = ref_feats.numpy()

    ids = torch.tensor(classes, dtype=torch.long).repeat_interleave(n_per_class)
    codes = [torch.as_tensor(generate_fn(chunk, seed + i)) for i, chunk in enumerate(ids.split(batch_size))]
    generated = _to_unit(bundle.decode_images(torch.cat(codes)))

    # the floor: real training images of the same classes and count (what a perfect generator would score)
    train = load_digits_split("train", size)
    g = torch.Generator().manual_seed(seed)
    rows = torch.cat([torch.nonzero(train.labels == c).flatten()[
        torch.randperm(int((train.labels == c).sum()), generator=g)[:n_per_class]] for c in classes])
    return {
        "classes": classes, "n_per_class": n_per_class, "seed": seed,
        "generated": _figures(bundle, generated, ids, ref_feats),
        "real_train_reference": _figures(bundle, train.images[rows], train.labels[rows], ref_feats),
        "heldout_accuracy": class_accuracy(bundle.evaluator.predict(held.images)[0].numpy(), held.labels.numpy()),
    }
