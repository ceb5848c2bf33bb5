"""The one thread that owns the engines: it takes submissions and cancellations from the asyncio side through a
command queue, steps every engine that has work, and resolves each image's future with its RequestResult.

An engine runs one DecodeConfig, so the worker keeps one engine per (method, sampling overrides) actually
requested, at most `max_engines` at once: the default one is built and warmed up before the service reports ready;
another is built, in this thread, when a request first needs it (its warm-up holds up the other engines' steps
meanwhile), replacing an idle one when the limit is reached. Each engine has a runner (KV cache) of its own. Busy
engines take turns, one step each, under the pipeline's lock (so nothing else uses its runners meanwhile).
"""
from __future__ import annotations

import logging
import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

from lantern.serve.metrics import ServeMetrics
from lantern.engine import Engine, Request

log = logging.getLogger("lantern.serve")
IDLE_POLL_S = 0.05  # how often an idle worker looks for commands


class Cancelled(Exception):
    """The image was cancelled (its client left, or its deadline passed) before it finished."""


class EngineFailed(Exception):
    """The engine raised while this image was in it: lantern's own bug (HTTP 500)."""


class EnginesBusy(Exception):
    """A request needs an engine of its own, and every engine the worker may keep is busy (HTTP 429)."""


@dataclass(frozen=True)
class EngineKey:
    method: str  # a named method, or "auto" (the plan made at warm-up)
    sampling: tuple = ()  # sorted (name, value) overrides of the bundle's sampling

    def __str__(self) -> str:
        return " ".join([self.method, *(f"{k}={v}" for k, v in self.sampling)])


@dataclass
class Job:
    request: Request
    key: EngineKey
    future: Future


class EngineWorker:
    def __init__(self, pipeline, make_decode: Callable[[EngineKey], tuple], default: EngineKey, width: int,
                 queue_limit: int, max_engines: int, metrics: ServeMetrics):
        """make_decode(key) -> (DecodeConfig, what runs: the method, or auto's plan), called in the worker thread
        (auto's first call plans, and may calibrate). queue_limit: images that may wait for a slot beyond the
        busy ones."""
        self.pipeline, self.make_decode, self.default = pipeline, make_decode, default
        self.width, self.queue_limit, self.max_engines, self.metrics = width, queue_limit, max_engines, metrics
        self.ready = threading.Event()
        self.failure: Optional[BaseException] = None  # warm-up failed: the service never becomes ready
        self.described: dict[str, str] = {}  # str(engine key) -> what it runs (auto: the plan it chose)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._engines: dict[EngineKey, Engine] = {}
        self._jobs: dict[str, Job] = {}  # request id -> job, owned by the worker thread
        self._outstanding = 0  # images admitted and not yet resolved
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lantern-engine", daemon=True)

    # ---- the asyncio side ----
    def start(self) -> None:
        """Start the thread (once: a second call does nothing)."""
        if self._thread.ident is None:
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def admit(self, n: int) -> bool:
        """Reserve room for n images: False when the slots and the queue are full (the caller answers 429)."""
        with self._lock:
            if self._outstanding + n > self.capacity:
                return False
            self._outstanding += n
            return True

    def release(self, n: int) -> None:
        """Give back room admitted but never submitted."""
        with self._lock:
            self._outstanding -= n

    @property
    def capacity(self) -> int:
        """Images admitted at once: one engine's slots and the queue (more engines share them)."""
        return self.width + self.queue_limit

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    def submit(self, key: EngineKey, requests: list[Request]) -> list[Future]:
        """Queue admitted images; each future resolves to its RequestResult, or raises Cancelled, ValueError (the
        engine refused the request), EnginesBusy or EngineFailed."""
        jobs = [Job(r, key, Future()) for r in requests]
        self._commands.put(("submit", jobs))
        return [j.future for j in jobs]

    def cancel(self, request_ids: list[str]) -> None:
        self._commands.put(("cancel", list(request_ids)))

    def stop(self, timeout: Optional[float] = None) -> None:
        """Finish every admitted image, then end the thread."""
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the worker thread ----
    def _run(self) -> None:
        try:
            with self.pipeline.lock:
                self._engine(self.default)
        except BaseException as e:  # noqa: BLE001  reported by /ready and the serve command
            self.failure = e
            log.error("warm-up failed: %s", e, exc_info=True)
            return
        finally:
            self.ready.set()
        while not (self._stopping and not self._jobs):
            self._take_commands(block=not self._jobs)
            for key, engine in list(self._engines.items()):
                if engine.busy or engine.waiting:
                    self._step(key, engine)
            self.metrics.slots_busy.set(sum(e.busy for e in self._engines.values()))
            self.metrics.queue_depth.set(sum(e.waiting for e in self._engines.values()))

    def _engine(self, key: EngineKey) -> Engine:
        """The engine for `key`, built and warmed up on first use (in place of an idle one at the limit)."""
        if key in self._engines:
            return self._engines[key]
        if len(self._engines) >= self.max_engines:
            busy = {j.key for j in self._jobs.values()}
            idle = [k for k in self._engines if k not in busy and k != self.default]
            if not idle:
                raise EnginesBusy(f"this request needs an engine of its own ({key}), and all {self.max_engines} "
                                  f"engines are busy")
            del self._engines[idle[0]]
        dcfg, what = self.make_decode(key)
        self._engines[key] = Engine(self.pipeline, dcfg, self.width, runner=self._runner(dcfg))
        self.described[str(key)] = what
        self.metrics.slots.set(self.width * len(self._engines))
        return self._engines[key]

    def _runner(self, dcfg):
        """The pipeline's runner for this shape (prepared and warmed up once), unless another engine uses it:
        then one of the engine's own, so no two engines share a KV cache."""
        runner = self.pipeline.runner(dcfg, self.width)
        if any(e.runner is runner for e in self._engines.values()):
            spec = runner.spec
            runner = self.pipeline.backend.prepare(self.pipeline.target,
                                                   self.pipeline.drafter if spec.draft_widths else None, spec)
            runner.warmup()
        return runner

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = command
            if kind == "submit":
                self._submit(payload)
            elif kind == "cancel":
                self._cancel(payload)
            else:
                self._stopping = True
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _submit(self, jobs: list[Job]) -> None:
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():  # its caller gave up already
                self._resolve(job)
                continue
            try:
                with self.pipeline.lock:
                    rid = self._engine(job.key).submit(job.request)
            except (ValueError, EnginesBusy) as e:
                self._resolve(job, error=e)
                continue
            except Exception as e:  # noqa: BLE001  our bug: the request fails, the service goes on
                log.error("engine %s failed to take a request: %s", job.key, e, exc_info=True)
                self._resolve(job, error=EngineFailed(str(e)))
                continue
            self._jobs[rid] = job

    def _cancel(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            job = self._jobs.pop(rid, None)
            if job is not None:
                self._engines[job.key].cancel(rid)
                self._resolve(job, error=Cancelled(rid))

    def _step(self, key: EngineKey, engine: Engine) -> None:
        try:
            with self.pipeline.lock:
                report = engine.step()
        except Exception as e:  # noqa: BLE001  the engine's state is unknown: fail its images, build it anew
            log.error("engine %s failed a step: %s\n%s", key, e, traceback.format_exc())
            del self._engines[key]
            for rid in [r for r, j in self._jobs.items() if j.key == key]:
                self._resolve(self._jobs.pop(rid), error=EngineFailed(str(e)))
            return
        self.metrics.observe_step(key.method, report)
        for result in report.finished:
            job = self._jobs.pop(result.request_id, None)
            if job is None:  # cancelled earlier: already answered
                continue
            if result.cancelled:
                self._resolve(job, error=Cancelled(result.request_id))
            else:
                self.metrics.observe_image(key.method, result.started_s - result.submitted_s,
                                           result.finished_s - result.started_s)
                self._resolve(job, result=result)

    def _resolve(self, job: Job, result=None, error: Optional[BaseException] = None) -> None:
        """Free the job's room and answer its future (running from here on: a caller can no longer cancel it)."""
        with self._lock:
            self._outstanding -= 1
        if job.future.cancelled():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)
