"""What every training stage shares: seeding, per-step RNG, the LR schedule, autocast, resumable checkpoints."""
from __future__ import annotations

import math
import os
import random
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from lantern.files import atomic_io
from lantern.files.reading import read_json_object


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The RNG for one training step: a pure function of (seed, step), so a resumed run sees the same batches."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warm-up to `peak`, then cosine decay to `final_frac * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def autocast(bf16: bool):
    """bf16 autocast on CPU: matmuls and convs run in bf16 (much faster with AVX512-BF16/AMX), losses in fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()


class Checkpoint:
    """`<out_dir>/<name>.ckpt`: model + optimiser + step, written atomically every few steps; resumed if present."""

    def __init__(self, out_dir: str | os.PathLike, name: str):
        self.path = Path(out_dir) / f"{name}.ckpt"

    def load(self, model: torch.nn.Module, opt: torch.optim.Optimizer, config: dict) -> tuple[int, float]:
        """Restore state if a checkpoint exists; returns (step to start from, training seconds so far)."""
        if not self.path.exists():
            return 0, 0.0
        state = torch.load(self.path, map_location="cpu", weights_only=True)  # tensors and plain data only
        if state["config"] != config:
            raise ValueError(f"checkpoint {self.path} was made with config {state['config']}, not {config}; "
                             f"delete it or use another output dir")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        return int(state["step"]), float(state["seconds"])

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, config: dict, step: int,
             seconds: float) -> None:
        """seconds: wall time spent training up to `step`, over every run that resumed this checkpoint."""
        with atomic_io.atomic_path(self.path) as tmp:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "config": config, "step": step,
                        "seconds": seconds}, tmp)


def save_weights(model: torch.nn.Module, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Float32 contiguous safetensors of a module's persistent state (optional string metadata)."""
    sd = {k: v.detach().float().contiguous() if v.is_floating_point() else v.detach().contiguous()
          for k, v in model.state_dict().items()}
    with atomic_io.atomic_path(path) as tmp:
        save_file(sd, str(tmp), metadata=metadata)


def finished_report(out_dir: str | os.PathLike, name: str, start: int, steps: int, weights: str) -> dict | None:
    """The stored report of a stage whose checkpoint is at its last step and whose outputs were written
    (a re-run then skips re-measuring); None when the stage still has work to do."""
    report, weights_path = Path(out_dir) / f"{name}_report.json", Path(out_dir) / weights
    if start == steps and report.exists() and weights_path.exists():
        return read_json_object(report)
    return None


def write_json(path: str | os.PathLike, obj: dict) -> None:
    atomic_io.write_json(path, obj, indent=2, sort_keys=True)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
