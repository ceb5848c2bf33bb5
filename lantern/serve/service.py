"""The service behind every front end (`lantern serve`'s ASGI app, the Ray Serve deployment): one bundle, one
pipeline, one engine worker, its metrics; a request's life from admission to its PNGs."""
from __future__ import annotations

import asyncio
import base64
import io
import math
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Awaitable, Callable

from PIL import Image

from lantern.api import Pipeline
from lantern.bundle import load_bundle
from lantern.decoding.config import method_preset, supported_methods
from lantern.decoding.sampling import SamplingConfig
from lantern.engine import Request, SamplingOverrides, derive_seed
from lantern.engine.sampling import PER_REQUEST
from lantern.serve.config import ServeConfig
from lantern.serve.metrics import ServeMetrics
from lantern.serve.schema import ImageRequest, ModelInfo
from lantern.serve.worker import EngineKey, EngineWorker


class Unavailable(Exception):
    """Not taking requests now (warming up, draining, or warm-up failed): HTTP 503."""


class QueueFull(Exception):
    """Every slot and queue place is taken: HTTP 429, retry after `retry_after_s`."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"the queue is full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    """The request's deadline passed before its images were done: HTTP 504; its images were cancelled."""


class ClientGone(Exception):
    """The client disconnected; its images were cancelled."""


class Service:
    def __init__(self, config: ServeConfig):
        config.check()
        self.config = config
        self.bundle = load_bundle(config.model)
        self.pipe = Pipeline.from_bundle(self.bundle, backend=config.backend, dtype=config.dtype,
                                         **config.backend_options)
        self.sampling = SamplingConfig(**self.bundle.default_sampling)
        can_run = [m for m in supported_methods(self.bundle.drafter is not None, self.bundle.proximity is not None)
                   if self._runs(m)]
        methods = list(config.methods) if config.methods is not None else can_run
        cannot = sorted({*methods, config.method} - {"auto"} - set(can_run))
        if cannot:
            raise ValueError(f"method {cannot[0]!r} cannot run on this bundle; allowed: auto, {', '.join(can_run)}")
        tcfg = self.pipe.config
        self.info = ModelInfo(name=config.served_name or Path(self.bundle.path).name, model_type=tcfg.model_type,
                              num_classes=tcfg.num_classes, image_size=self.bundle.vq.config.image_size,
                              methods=("auto", *[m for m in methods if m != "auto"]), max_n=config.max_n,
                              max_timeout_s=config.max_timeout_s)
        self.metrics = ServeMetrics()
        self.worker = EngineWorker(self.pipe, self._decode, EngineKey(config.method), config.batch, config.queue,
                                   config.max_engines, self.metrics)
        self.draining = False
        self._choice = None  # auto's plan, made once at warm-up

    def _runs(self, method: str) -> bool:
        """Whether this pipeline can run a method at its presets (e.g. a relaxed preset's k may exceed a small
        proximity table)."""
        try:
            self.pipe.check(self._decode_named(method), self.config.batch)
        except ValueError:
            return False
        return True

    def _decode_named(self, method: str):
        return method_preset(method, self.sampling, **self.bundle.relaxation_defaults.get(method, {}))

    def _decode(self, key: EngineKey) -> tuple:
        """(DecodeConfig, what runs) of an engine key (worker thread). auto plans once, for a full batch of slots
        at the bundle's sampling; sampling overrides then replace the sampling of the plan's decode config."""
        sampling = replace(self.sampling, **dict(key.sampling))
        if key.method != "auto":
            return replace(self._decode_named(key.method), sampling=sampling), str(key)
        if self._choice is None:
            self._choice = self.pipe.plan(self.config.batch, self.sampling, batch=self.config.batch,
                                          allow_relaxed=self.config.allow_relaxed, progress=False)
        return replace(self._choice.decode, sampling=sampling), f"auto: {self._choice.plan.name}"

    def start(self) -> None:
        self.worker.start()

    @property
    def ready(self) -> bool:
        return self.worker.ready.is_set() and self.worker.failure is None and not self.draining

    def status(self) -> str:
        if self.worker.failure is not None:
            return f"warm-up failed: {self.worker.failure}"
        if self.draining:
            return "draining: finishing the requests in flight, taking no new ones"
        return "ready" if self.worker.ready.is_set() else "warming up"

    def retry_after_s(self) -> int:
        """Seconds until the queue is likely to have room: the outstanding images at the recent rate."""
        rate = self.metrics.recent_rate()
        return max(1, math.ceil(self.worker.outstanding / rate)) if rate > 0 else 1

    async def generate(self, req: ImageRequest, disconnected: Callable[[], Awaitable]) -> dict:
        """Admit, queue, wait (for the images, the deadline or the client leaving, whichever comes first), encode.
        disconnected(): an awaitable that returns when the client goes away. Raises Unavailable, QueueFull,
        ValueError (the engine refused the request), DeadlineExceeded, ClientGone."""
        if not self.ready:
            raise Unavailable(self.status())
        if not self.worker.admit(req.n):
            raise QueueFull(self.retry_after_s())
        rid = uuid.uuid4().hex[:16]
        key = self.engine_key(req)
        per_request = {k: v for k, v in req.sampling.items() if k in PER_REQUEST and k not in dict(key.sampling)}
        overrides = SamplingOverrides(**per_request) if per_request else None
        requests = [Request(condition=req.condition, seed=derive_seed(req.seed, i), request_id=f"{rid}-{i}",
                            sampling=overrides) for i in range(req.n)]
        futures = [asyncio.wrap_future(f) for f in self.worker.submit(key, requests)]
        images = asyncio.ensure_future(asyncio.gather(*futures))
        gone = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({images, gone}, timeout=req.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if images not in done:
                raise ClientGone() if gone in done else DeadlineExceeded(
                    f"the request's deadline of {req.timeout_s:g} s passed; its images were cancelled")
            results = images.result()
        finally:
            gone.cancel()
            if not images.done():
                images.cancel()
                self.worker.cancel([r.request_id for r in requests])
        pngs = await asyncio.to_thread(self._pngs, [r.tokens for r in results])
        return self._response(req, rid, results, pngs)

    def engine_key(self, req: ImageRequest) -> EngineKey:
        """The engine a request runs on: its method ("auto": the server's) and the sampling an engine fixes that
        the request sets apart from the bundle's: top_k, top_p, and a cfg_scale that turns guidance on (it adds
        rows to the static shape). Temperature and any other cfg_scale go with the request to the engine
        (lantern.engine.sampling)."""
        method = self.config.method if req.method == "auto" else req.method
        differ = {k: v for k, v in req.sampling.items() if v != getattr(self.sampling, k)}
        fixed = {k: v for k, v in differ.items() if k not in PER_REQUEST}
        if differ.get("cfg_scale", 1.0) > 1 and not self.sampling.use_cfg:
            fixed["cfg_scale"] = differ["cfg_scale"]
        return EngineKey(method, tuple(sorted(fixed.items())))

    def _pngs(self, tokens: list) -> list[str]:
        import torch
        images = self.bundle.decode_images(torch.stack(tokens))
        out = []
        for img in images:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            out.append(base64.b64encode(buf.getvalue()).decode())
        return out

    def _response(self, req: ImageRequest, rid: str, results: list, pngs: list[str]) -> dict:
        key = str(self.engine_key(req))
        runs = self.worker.described.get(key, key)
        data = []
        for i, (result, png) in enumerate(zip(results, pngs)):
            st = result.stats
            item = {"b64_json": png, "index": i, "class_id": req.condition, "stats": {
                "steps": st.target_forwards, "tokens": st.tokens,
                "mean_accepted_length": st.mean_accepted_length, "method": runs, "backend": self.pipe.backend.name,
                "dtype": self.pipe.dtype, "queue_wait_s": result.started_s - result.submitted_s,
                "decode_s": result.finished_s - result.started_s}}
            if req.return_tokens:
                item["tokens"] = result.tokens.tolist()
            data.append(item)
        return {"created": int(time.time()), "id": rid, "model": self.info.name, "seed": req.seed, "data": data}
