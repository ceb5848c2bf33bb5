"""The stable Python API: a Pipeline holds models and a backend, prepares each static shape once, and
generates images' tokens with any decoding method, returning them with their stats and profile."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from lantern.backends import Runner, get_backend
from lantern.decoding.config import DecodeConfig
from lantern.decoding.loop import condition_rows, decode_ar, decode_speculative, static_spec
from lantern.decoding.stats import GenerationStats


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (n, block_size) image tokens, raster order
    conditions: list  # class ids (c2i) or caption indices (t2i)
    stats: GenerationStats
    backend: str
    device: str
    dtype: str
    decode: DecodeConfig
    seed: int
    profile: dict = field(default_factory=dict)  # the runner's profile record (phases, memory, warm-up)


def check_classes(classes: Sequence[int], num_classes: int) -> list[int]:
    if not len(classes):
        raise ValueError("no class ids given")
    out = []
    for c in classes:
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < num_classes:
            raise ValueError(f"class id {c!r} is out of range; allowed: integers 0..{num_classes - 1}")
        out.append(c)
    return out


class Pipeline:
    def __init__(self, target, drafter=None, proximity: Optional[torch.Tensor] = None, backend: str | None = None,
                 dtype: str | None = None, **backend_options):
        """dtype None = the backend's preferred one (fp32 on CPU and CUDA, bf16 on HPU)."""
        self.target, self.drafter, self.proximity = target.eval(), drafter, proximity
        self.backend = get_backend(backend, **backend_options)
        self.dtype = dtype or self.backend.capabilities().dtypes[0]
        self.backend.check_dtype(self.dtype)
        self._runners: dict = {}

    @property
    def config(self):
        return self.target.config

    def runner(self, dcfg: DecodeConfig, images: int) -> Runner:
        """The runner for this static shape: prepared and warmed up once, then reused."""
        spec = static_spec(dcfg, self.config, images, self.dtype)
        if spec not in self._runners:
            if spec.draft_widths and self.drafter is None:
                raise ValueError(f"drafting {dcfg.drafting!r} needs a drafter, and this pipeline has none")
            runner = self.backend.prepare(self.target, self.drafter if spec.draft_widths else None, spec)
            runner.warmup()
            self._runners[spec] = runner
        return self._runners[spec]

    def _cond(self, conditions) -> torch.Tensor:
        if self.config.model_type == "c2i":
            return torch.tensor(check_classes(list(conditions), self.config.num_classes), dtype=torch.long)
        cond = torch.as_tensor(conditions, dtype=torch.float32)
        want = (self.config.cls_token_num, self.config.caption_dim)
        if cond.dim() != 3 or tuple(cond.shape[1:]) != want:
            raise ValueError(f"t2i conditions must be caption embeddings of shape (n, {want[0]}, {want[1]}), "
                             f"got {tuple(cond.shape)}")
        return cond

    def generate(self, conditions, dcfg: DecodeConfig, seed: int = 0, progress: bool = False) -> GenerationResult:
        """conditions: class ids (c2i) or caption embeddings (n, P, C) (t2i). Same seed, same backend ->
        same tokens. AR decodes all images as one batch; speculative decoding goes one image at a time
        (with `progress`, a bar on stderr counts them)."""
        cond = self._cond(conditions)
        n, block = cond.shape[0], self.config.block_size
        generator = torch.Generator().manual_seed(seed)
        null = self.target.null_condition(1)
        runner = self.runner(dcfg, n)
        runner.reset_times()
        runner.reset_peak_memory()
        if not dcfg.speculative:
            rows = condition_rows(cond, dcfg, null.expand(n, *null.shape[1:]))
            tokens, stats = decode_ar(runner, rows, dcfg, n, block, generator)
        else:
            stats, outs = GenerationStats(), []
            for i in tqdm(range(n), desc=f"{dcfg.drafting} images", disable=not progress or n == 1, file=sys.stderr):
                rows = condition_rows(cond[i:i + 1], dcfg, null)
                toks, st = decode_speculative(runner, rows, dcfg, block, generator, self.proximity)
                outs.append(toks)
                stats.merge(st)
            tokens = torch.stack(outs)
        stats.phase_seconds = {k: v["total_s"] for k, v in runner.profile()["phases"].items()}
        caps = self.backend.capabilities()
        conds = cond.tolist() if self.config.model_type == "c2i" else list(range(n))
        return GenerationResult(tokens=tokens, conditions=conds, stats=stats, backend=self.backend.name,
                                device=caps.device, dtype=self.dtype, decode=dcfg, seed=seed,
                                profile=runner.profile())
