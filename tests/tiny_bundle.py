"""A tiny bundle folder written by the project's own code (no downloads): random GPT-test target (4 classes,
4x4 tokens), drafter, proximity table and a tiny VQ decoder, with a manifest that verifies."""
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from lantern.bundle import sha256_file, weights_hash
from lantern.models.config import gpt_preset
from lantern.models.vq import VQConfig, VQModel
from lantern.embedded.train.common import save_weights
from conftest import make_models


def write_tiny_bundle(root: Path, cfg_scale: float = 1.0, drafter_too: bool = True) -> Path:
    """drafter_too=False: the target alone, so `--method auto` has only the Jacobi plans to record and calibrate."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = gpt_preset("GPT-test")
    target, drafter, proximity = make_models(cfg)
    torch.manual_seed(0)
    vq_cfg = VQConfig(codebook_size=cfg.vocab_size, codebook_embed_dim=4, ch=8, ch_mult=(1, 2), z_channels=8,
                      norm_groups=4, image_size=8)
    save_weights(VQModel(vq_cfg), root / "vq.safetensors")
    save_weights(target, root / "target.safetensors")
    if drafter_too:
        save_weights(drafter, root / "drafter.safetensors",
                     metadata={"target_hash": weights_hash(target.state_dict())})
        save_file({"neighbours": proximity.to(torch.int32).contiguous()}, str(root / "proximity.safetensors"))
    config = {"vq": asdict(vq_cfg), "target": asdict(cfg),
              "sampling": {"cfg_scale": cfg_scale, "temperature": 1.0, "top_k": 0}}
    (root / "config.json").write_text(json.dumps(config))
    files = {f.name: sha256_file(f) for f in sorted(root.iterdir()) if f.is_file()}
    (root / "manifest.json").write_text(json.dumps({"name": "tiny test bundle", "files": files}))
    return root
