"""The service behind every front end (`lantern serve`'s ASGI app, the Ray Serve deployment): one model (a bundle,
or a Janus / Chameleon folder: lantern.serve.families), one pipeline, one engine worker, its metrics; a request's
life from admission to its PNGs.

Throughput defaults: the steps run with `threads` intra-op threads (default: the physical cores), and with
`method` auto the service is ready at once on the safe plan (AR), while a background thread plans (with no backend
pinned, weighing every mode of the machine: eager, compiled, fused, ONNX Runtime; lantern.plan.backend_choice)
against `plan_images` images, so a one-time compile pays off over a service's life, prepares what it chose and
switches to it at a step boundary (lantern.serve.planning). On a family folder auto plans on the backend given,
among lossless plans only, as `lantern generate --method auto` does there."""
from __future__ import annotations

import asyncio
import base64
import inspect
import io
import logging
import math
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Awaitable, Callable

import psutil
import torch
from PIL import Image

from lantern.api import Pipeline
from lantern.backends import backend_class, resolve_name
from lantern.decoding.config import method_preset, supported_methods
from lantern.decoding.sampling import SamplingConfig
from lantern.engine import Request, SamplingOverrides, derive_seed
from lantern.engine.slot_sampling import PER_REQUEST
from lantern.models.text import T5Conditioner, check_encoder_fits
from lantern.plan.backend_choice import plan_request
from lantern.plan.validated import guarded
from lantern.serve.config import ServeConfig
from lantern.serve.families import FamilyModel, check_model, load_model
from lantern.serve.metrics import ServeMetrics
from lantern.serve.planning import BackgroundPlanner, ServingPlan, safe_plan
from lantern.serve.prompts import PromptBatcher
from lantern.serve.schema import ImageRequest, ModelInfo
from lantern.serve.worker import EngineKey, EngineWorker

log = logging.getLogger("lantern.serve")
PLANNER_STOP_S = 10.0  # how long stopping waits for the background calibration to reach its next turn


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
        self.threads = config.threads or physical_cores()
        check_model(config)
        self.model = load_model(config)  # a Bundle, or a FamilyModel
        self.family = self.model if isinstance(self.model, FamilyModel) else None
        self.prompts = self._prompt_batcher() if self.model.target.config.model_type == "t2i" else None
        # a family's auto measures its acceptance on these prompt rows (tokenized here: one thread uses the tokenizer)
        self.calibration_rows = self.family.calibration_rows() if self.family is not None else None
        self.pipe = self._pipeline(config.backend, config.dtype)
        self.sampling = SamplingConfig(**self.model.default_sampling)
        can_run = [m for m in supported_methods(self.model.drafter is not None, self.model.proximity is not None)
                   if self._runs(m)]
        methods = list(config.methods) if config.methods is not None else can_run
        cannot = sorted({*methods, config.method} - {"auto"} - set(can_run))
        if cannot:
            what = "bundle" if self.family is None else f"{self.family.name} folder"
            raise ValueError(f"method {cannot[0]!r} cannot run on this {what}; allowed: auto, {', '.join(can_run)}")
        tcfg = self.pipe.config
        self.info = ModelInfo(name=config.served_name or Path(self.model.path).name, model_type=tcfg.model_type,
                              num_classes=getattr(tcfg, "num_classes", 0), image_size=self.model.image_size,
                              methods=("auto", *[m for m in methods if m != "auto"]), max_n=config.max_n,
                              max_timeout_s=config.max_timeout_s,
                              prompt_row=self.family.prompt_row if self.family is not None else None)
        self.metrics = ServeMetrics()
        self.worker = EngineWorker(self.pipe, self._decode, EngineKey(config.method), config.ladder, config.queue,
                                   config.max_engines, self.metrics, setup=self._setup,
                                   hold_s=config.width_hold_s)
        self.metrics.watch_peak_memory(self.worker.peak_memory_bytes)
        self.draining = False
        self.serving: ServingPlan = safe_plan(self.pipe.backend.name, self.sampling)  # what auto serves now
        # every width's engine, each prompt row as long as max_prompt_tokens, before any engine is built
        self.pipe.check_ladder_fits(self._decode(EngineKey(config.method))[0], config.ladder,
                                    shortest_prompt=self.family.shortest_prompt if self.family is not None else None)
        self.planner = (BackgroundPlanner(self._plan, self.worker, config.ladder, self.threads, self._switched,
                                          lambda state: self._report_plan())
                        if config.method == "auto" else None)

    def _pipeline(self, backend, dtype, **mode_options) -> Pipeline:
        """The model's pipeline on `backend`, its steps at the service's thread count where the backend takes
        one (torch CPU modes, ONNX Runtime); mode_options: auto's mode (fused_step)."""
        options = {**self.config.backend_options, **mode_options}
        if "threads" in inspect.signature(backend_class(resolve_name(backend)).__init__).parameters:
            options["threads"] = self.threads
        return Pipeline.from_bundle(self.model, backend=backend, dtype=dtype, **options)

    def _prompt_batcher(self) -> PromptBatcher:
        """t2i: the T5 encoder (config.t5, else $LANTERN_T5), checked against the GPT's caption shape."""
        cfg = self.model.target.config
        encoder = T5Conditioner(self.config.t5, max_tokens=cfg.cls_token_num)
        check_encoder_fits(encoder, cfg)
        return PromptBatcher(encoder)

    def _setup(self) -> Pipeline:
        """Worker thread, before the default engines are built: its torch threads (set once, so the steps never
        switch the count). Auto serves the safe plan until its background planner switches."""
        torch.set_num_threads(self.threads)
        return self.pipe

    def _plan(self) -> tuple[Pipeline, ServingPlan]:
        """The planner's thread: auto's plan (lantern.plan.backend_choice.plan_request, as `lantern generate`'s) for
        a full batch at the model's sampling, weighed over `plan_images` images, on pipelines of its own (the serving
        one is the worker's); a family folder's acceptance measured on CALIBRATION_PROMPTS (lantern.serve.families)."""
        cfg = self.config
        choice = plan_request(self._pipeline(cfg.backend, cfg.dtype), cfg.plan_images, self.sampling, self._pipeline,
                              batch=cfg.batch, allow_relaxed=cfg.allow_relaxed, progress=False,
                              prompts=self.calibration_rows)
        return choice.pipeline, ServingPlan(choice.plan.name, choice.decode,
                                            f"{choice.why}; weighed over {cfg.plan_images} images, calibrated and "
                                            f"prepared in the background at widths {', '.join(map(str, cfg.ladder))}")

    def _switched(self, pipe: Pipeline, plan: ServingPlan) -> None:
        """Worker thread, at the step boundary of the switch: the chosen plan serves from now on."""
        self.pipe, self.serving = pipe, plan
        self.metrics.plan_switches.inc()
        log.info("plan", extra={"fields": {"event": "plan", "plan": plan.name, "backend": pipe.backend.name,
                                           "fused_step": pipe.backend.fused_step,
                                           "why": plan.why}})

    def _report_plan(self) -> None:
        auto = self.planner is not None
        self.metrics.serving({"auto": (self.serving.name, self.pipe.backend.name)} if auto else {},
                             auto and self.planner.running)

    def describe(self) -> dict:
        """What serves: backend (fused_step: the whole step as one graph), dtype, threads, widths, what each
        engine runs (auto: its plan), and auto's plan: why, and its calibration's state (`calibration`: waiting,
        calibrating, switching, done, failed: <why>, stopped; None without auto)."""
        return {"backend": self.pipe.backend.name, "fused_step": self.pipe.backend.fused_step,
                "dtype": self.pipe.dtype, "threads": self.threads,
                "widths": list(self.worker.widths), "methods": dict(self.worker.described),
                "plan": self.serving.why if self.planner is not None else None,
                "calibration": self.planner.state if self.planner is not None else None,
                "family": self.pipe.config.family,
                "prompts": "t5" if self.prompts is not None else "tokenizer" if self.family is not None else None,
                "max_prompt_tokens": self.family.prompt_len if self.family is not None else None}

    def _runs(self, method: str) -> bool:
        """Whether this pipeline can run a method at its presets (e.g. a relaxed preset's k may exceed a small
        proximity table)."""
        try:
            self.pipe.check(self._decode_named(method), self.config.batch)
        except ValueError:
            return False
        return True

    def _decode_named(self, method: str):
        """A named method at the service's sampling, as Pipeline.generate runs it: a relaxed one relaxed only where
        the bundle validated it (or with allow_relaxed), else lossless (lantern.plan.validated.guarded)."""
        return guarded(method_preset(method, self.sampling), self.model.validations,
                       self.model.target.config.vocab_size, self.config.allow_relaxed)[0]

    def _decode(self, key: EngineKey) -> tuple:
        """(DecodeConfig, what runs) of an engine key (worker thread). auto plans once, for a full batch of slots
        at the model's sampling; sampling overrides then replace the sampling of the plan's decode config."""
        sampling = replace(self.sampling, **dict(key.sampling))
        if key.method != "auto":
            return replace(self._decode_named(key.method), sampling=sampling), str(key)
        return replace(self.serving.decode, sampling=sampling), f"auto: {self.serving.name}"

    def start(self) -> None:
        """The engine worker, and with auto its background planner (it starts planning once the worker is ready)."""
        self._report_plan()
        self.worker.start()
        if self.planner is not None:
            self.planner.start()

    def stop(self) -> None:
        """Finish every admitted image, then stop the engine worker and the prompt encoder. A background
        calibration stops at its next turn: it is waited for, PLANNER_STOP_S at most (a compile or an export in
        progress cannot be interrupted; `planner.alive` then says so)."""
        self.worker.stop()
        if self.planner is not None:
            self.planner.join(PLANNER_STOP_S)
        if self.prompts is not None:
            self.prompts.close()

    def abandon(self) -> None:
        """Stop at once: the images in flight are cancelled, their requests answered 503 (a second stop signal)."""
        self.draining = True
        self.worker.abandon()

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
        try:
            condition = await self._condition(req)
        except BaseException:
            self.worker.release(req.n)
            raise
        rid = uuid.uuid4().hex[:16]
        key = self.engine_key(req)
        per_request = {k: v for k, v in req.sampling.items() if k in PER_REQUEST and k not in dict(key.sampling)}
        overrides = SamplingOverrides(**per_request) if per_request else None
        requests = [Request(condition=condition, seed=derive_seed(req.seed, i), request_id=f"{rid}-{i}",
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
            ran = [self.worker.ran.pop(r.request_id, None) for r in requests]  # what ran each image
        self.metrics.request_queue_wait.observe(max(r.started_s - r.submitted_s for r in results))
        tokens = [r.tokens for r in results]  # to images in the worker thread: no torch beside the steps
        pngs = await asyncio.wrap_future(self.worker.call(lambda: self._timed("pixels", self._pngs, tokens)))
        return self._response(req, rid, results, ran, pngs)

    def _timed(self, stage: str, fn, *args):
        """fn(*args), its seconds observed as `stage` (lantern:stage_gen_time_s)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.metrics.stage_time.labels(stage).observe(time.perf_counter() - t0)

    async def _condition(self, req: ImageRequest):
        """c2i: the class id; t2i: the prompt's caption condition (encoded with other requests' prompts); a family
        folder: the prompt's token row (made when the request was read), left-padded to the engines' prefix."""
        if self.family is not None:
            return self.family.condition(req.prompt_ids)
        if self.prompts is None:
            return req.condition
        t0 = time.perf_counter()
        condition = await asyncio.wrap_future(self.prompts.encode(req.condition))
        self.metrics.stage_time.labels("encode").observe(time.perf_counter() - t0)
        return condition

    def engine_key(self, req: ImageRequest) -> EngineKey:
        """The engine a request runs on: its method ("auto": the server's) and the sampling an engine fixes that
        the request sets apart from the model's: top_k, top_p, and a cfg_scale that turns guidance on (it adds
        rows to the static shape). Temperature and any other cfg_scale go with the request to the engine
        (lantern.engine.slot_sampling)."""
        method = self.config.method if req.method == "auto" else req.method
        differ = {k: v for k, v in req.sampling.items() if v != getattr(self.sampling, k)}
        fixed = {k: v for k, v in differ.items() if k not in PER_REQUEST}
        if differ.get("cfg_scale", 1.0) > 1 and not self.sampling.use_cfg:
            fixed["cfg_scale"] = differ["cfg_scale"]
        return EngineKey(method, tuple(sorted(fixed.items())))

    def _pngs(self, tokens: list) -> list[str]:
        images = self.model.decode_images(torch.stack(tokens))
        out = []
        for img in images:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            out.append(base64.b64encode(buf.getvalue()).decode())
        return out

    def _response(self, req: ImageRequest, rid: str, results: list, ran: list[tuple], pngs: list[str]) -> dict:
        """ran: (what ran it, its backend) per image."""
        data = []
        for i, (result, (runs, backend), png) in enumerate(zip(results, ran, pngs)):
            st = result.stats
            stats = {"steps": st.target_forwards, "width": st.batch, "tokens": st.tokens,
                     "mean_accepted_length": st.mean_accepted_length, "method": runs,
                     "backend": backend, "dtype": self.pipe.dtype,
                     "queue_wait_s": result.started_s - result.submitted_s,
                     "decode_s": result.finished_s - result.started_s}
            given = "prompt" if isinstance(req.condition, str) else "class_id"
            item = {"b64_json": png, "index": i, given: req.condition, "stats": stats}
            if req.return_tokens:
                item["tokens"] = result.tokens.tolist()
            data.append(item)
        return {"created": int(time.time()), "id": rid, "model": self.info.name, "seed": req.seed, "data": data}


def physical_cores() -> int:
    """The machine's physical cores (logical ones where psutil cannot tell)."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1
