"""A stand-in with the step engine's interface (Engine / Request / RequestResult / StepReport, see
lantern.engine) that runs `Pipeline.generate` one request at a time: no continuous batching, one image per step.
The service uses it only until the step engine is available."""
from __future__ import annotations

import hashlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from lantern.decoding.config import DecodeConfig
from lantern.decoding.stats import GenerationStats


def derive_seed(seed: int, index: int) -> int:
    """Image `index` of a request seeded `seed` runs with this seed."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class Request:
    condition: object
    seed: int
    request_id: str = ""
    sampling: Optional[dict] = None  # overrides of the engine's sampling: temperature, top_k, top_p, cfg_scale
    tokens: Optional[int] = None


@dataclass
class RequestResult:
    request_id: str
    tokens: torch.Tensor  # (block,)
    stats: GenerationStats
    submitted_s: float
    started_s: float
    finished_s: float
    cancelled: bool = False


@dataclass
class StepReport:
    slots_busy: int
    finished: list = field(default_factory=list)
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list = field(default_factory=list)


class Engine:
    def __init__(self, pipeline, decode: DecodeConfig, width: int, runner=None):
        self.pipeline, self.decode, self.width, self.runner = pipeline, decode, width, runner
        self._queue: deque = deque()
        self._ids = itertools.count()

    def submit(self, request: Request) -> str:
        self.pipeline._cond([request.condition])  # refuses a bad condition now
        rid = request.request_id or f"r{next(self._ids)}"
        self._queue.append((replace(request, request_id=rid), time.perf_counter()))
        return rid

    def cancel(self, request_id: str) -> bool:
        for item in self._queue:
            if item[0].request_id == request_id:
                self._queue.remove(item)
                return True
        return False

    @property
    def busy(self) -> int:
        return 0

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def step(self) -> StepReport:
        if not self._queue:
            return StepReport(slots_busy=0)
        request, submitted = self._queue.popleft()
        dcfg = self.decode
        if request.sampling:
            dcfg = replace(dcfg, sampling=replace(dcfg.sampling, **request.sampling))
        started = time.perf_counter()
        out = self.pipeline.generate([request.condition], dcfg, seed=request.seed, batch=1, tokens=request.tokens)
        result = RequestResult(request.request_id, out.tokens[0], out.stats, submitted, started, time.perf_counter())
        steps = out.stats.accepted_lengths if dcfg.speculative else []
        per_position = [0] * max((n - 1 for n in steps), default=0)
        for n in steps:
            for d in range(n - 1):
                per_position[d] += 1
        return StepReport(slots_busy=1, finished=[result], drafts=len(steps),
                          draft_tokens=len(steps) * (dcfg.strategy.depth if dcfg.speculative else 0),
                          accepted_tokens=sum(n - 1 for n in steps), accepted_per_position=per_position)
