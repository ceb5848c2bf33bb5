"""A small CNN digit classifier: the evaluator behind class accuracy and the Frechet distance of samples."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lantern.models.config import ConfigFields


@dataclass(frozen=True)
class ClassifierConfig(ConfigFields):
    num_classes: int = 10
    image_size: int = 32
    width: int = 32  # channels of the first stage; doubled at each of the 3 stages
    feature_dim: int = 64  # penultimate features: the Frechet-distance space


def _stage(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                         nn.MaxPool2d(2))


class Classifier(nn.Module):
    def __init__(self, cfg: ClassifierConfig = ClassifierConfig()):
        super().__init__()
        self.config = cfg
        w = cfg.width
        self.stages = nn.Sequential(_stage(3, w), _stage(w, 2 * w), _stage(2 * w, 4 * w))
        self.fc = nn.Linear(4 * w, cfg.feature_dim)
        self.out = nn.Linear(cfg.feature_dim, cfg.num_classes)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, feature_dim) penultimate activations."""
        s = self.config.image_size
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, s, s):
            raise ValueError(f"images of shape {tuple(images.shape)}; expected (B, 3, {s}, {s})")
        h = self.stages(images).mean((2, 3))  # global average pool -> (B, 4w)
        return F.relu(self.fc(h))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(images))  # (B, num_classes) logits

    @torch.no_grad()
    def predict(self, images: torch.Tensor, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (labels (B,), features (B, feature_dim)), in eval mode."""
        self.eval()
        feats = torch.cat([self.features(images[i:i + batch]) for i in range(0, len(images), batch)])
        return self.out(feats).argmax(-1), feats
