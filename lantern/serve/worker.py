"""The one thread that owns the engines: it takes submissions and cancellations from the asyncio side through a
command queue, steps every engine that has work, and resolves each image's future with its RequestResult.

Per (method, sampling overrides) requested the worker keeps a ladder of engines, one per static width, at most
`max_engines` ladders (the default one warmed up at every width before the service is ready, another built width by
width on first use in this thread, replacing an idle ladder); a new image goes to the narrowest width that fits the
ladder's load, or its highest load within `hold_s`, and never moves (docs/serving.md, "Engines"). Busy engines take
turns, one step each. The engines' runners come from their pipeline (Pipeline.runner, as a generation's do), and
this thread is the only one that steps them: auto's background planner plans on pipelines of its own.

Work from another thread that must not share the cores with the steps (a background calibration's timed runs)
takes a turn (`quiet_turn`): it waits until no image is admitted, or TURN_PATIENCE_S under constant load (then it
comes between two steps), and the steps wait while it holds the turn. A new plan (`switch`) takes effect at a step
boundary: every ladder is retired (its engines keep stepping until their images are done, so an image runs on one
engine, one plan, from its first step to its last) and new requests go to ladders built on the new pipeline, the
default one at once.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

from lantern.serve.metrics import ServeMetrics
from lantern.engine import Engine, Request

log = logging.getLogger("lantern.serve")
IDLE_POLL_S = 0.05  # how often an idle worker looks for commands
TURN_PATIENCE_S = 5.0  # the most another thread's turn waits for the service to have no image (so a replica that
# starts under load still calibrates; each turn then delays the images in flight by its length)


class Cancelled(Exception):
    """The image was cancelled (its client left, or its deadline passed) before it finished."""


class EngineFailed(Exception):
    """The engine raised while this image was in it: lantern's own bug (HTTP 500)."""


class EnginesBusy(Exception):
    """A request needs an engine of its own, and every engine the worker may keep is busy (HTTP 429)."""


class ShutDown(Exception):
    """The service was stopped before the image finished (a second stop signal while draining): HTTP 503."""


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
    width: int = 0  # the width of the key's ladder it runs on (set when submitted to it)
    engine: Optional[Engine] = None  # the engine it runs on (set when submitted to it)
    runs: tuple = ()  # (what that engine runs, its backend), set when submitted to it


@dataclass
class RecentLoad:
    """A ladder's highest load (images in flight and queued) seen within the last `hold_s` seconds."""
    hold_s: float
    peak: int = 0
    seen_s: float = float("-inf")  # when `peak` was last seen

    def see(self, load: int, now: float) -> None:
        if load >= self.peak or now - self.seen_s > self.hold_s:
            self.peak, self.seen_s = load, now

    def at(self, now: float) -> int:
        return self.peak if now - self.seen_s <= self.hold_s else 0


def fitting_width(widths: tuple[int, ...], load: int) -> int:
    """The narrowest of `widths` (ascending) with a slot for each of `load` images; the widest when none has."""
    return next((w for w in widths if w >= load), widths[-1])


class WorkerStopped(Exception):
    """The worker ended while another thread waited for a turn."""


class EngineWorker:
    def __init__(self, pipeline, make_decode: Callable[[EngineKey], tuple], default: EngineKey,
                 widths: tuple[int, ...], queue_limit: int, max_engines: int, metrics: ServeMetrics,
                 setup: Optional[Callable[[], object]] = None, hold_s: float = 0.0):
        """make_decode(key) -> (DecodeConfig, what runs: the method, or auto's plan), called in the worker thread
        (auto's first call plans, and may calibrate). widths: the ladder's static widths, ascending. queue_limit:
        images that may wait for a slot beyond the widest engine's. setup(): (optional) run first in the worker
        thread, returns the pipeline the engines run on (auto's backend choice); default: `pipeline`. hold_s: how
        long a ladder's load counts for placing new images after it fell (0: only the load of the moment)."""
        self.pipeline, self.make_decode, self.default, self.setup = pipeline, make_decode, default, setup
        self.widths = tuple(sorted(widths))
        self.queue_limit, self.max_engines, self.metrics = queue_limit, max_engines, metrics
        self.ready = threading.Event()
        self.failure: Optional[BaseException] = None  # warm-up failed: the service never becomes ready
        self.described: dict[str, str] = {}  # str(engine key) -> what it runs (auto: the plan it chose)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._engines: dict[EngineKey, dict[int, Engine]] = {}  # key -> width -> engine (built on first use)
        self._retiring: list[tuple[EngineKey, int, Engine]] = []  # engines of a former plan, finishing their images
        self._turn = threading.Lock()  # held by the worker while it steps, or by another thread's turn (quiet_turn)
        self._turn_wanted = threading.Event()  # another thread waits for the turn: the worker lets it in first
        self.switches = 0  # plans switched to since start
        self.ran: dict[str, tuple] = {}  # request id -> (what ran it, the backend) of each image answered, until
        # the caller takes it (pop): a plan switch may come between an image's submission and its answer
        self._jobs: dict[str, Job] = {}  # request id -> job, owned by the worker thread
        self.hold_s = hold_s
        self._recent: dict[EngineKey, RecentLoad] = {}  # key -> its ladder's recent highest load (worker thread)
        self._outstanding = 0  # images admitted and not yet resolved
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = False  # the thread has ended: call() runs its function in the caller's thread
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
        """Images admitted at once: the widest engine's slots and the queue (every engine shares them)."""
        return self.widths[-1] + self.queue_limit

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    def submit(self, key: EngineKey, requests: list[Request]) -> list[Future]:
        """Queue admitted images; each future resolves to its RequestResult, or raises Cancelled, ValueError (the
        engine refused the request), EnginesBusy, EngineFailed or ShutDown (the worker stopped first)."""
        jobs = [Job(r, key, Future()) for r in requests]
        with self._lock:
            if not self._closed:
                self._commands.put(("submit", jobs))
                return [j.future for j in jobs]
        for job in jobs:  # the thread has ended (stopped, or its warm-up failed): nothing will run them
            self._resolve(job, error=ShutDown("the service stopped before this image started"))
        return [j.future for j in jobs]

    def cancel(self, request_ids: list[str]) -> None:
        self._commands.put(("cancel", list(request_ids)))

    def switch(self, pipeline, apply: Callable[[], None]) -> None:
        """At the next step boundary: apply() (the caller's new plan, which make_decode then returns), retire every
        ladder, and build the default ladder on `pipeline` at every width. The images in flight finish on the
        engines they started on."""
        self._commands.put(("switch", (pipeline, apply)))

    @contextlib.contextmanager
    def quiet_turn(self, patience_s: float = TURN_PATIENCE_S, poll_s: float = IDLE_POLL_S):
        """Hold the cores for a while: waits until no image is admitted, or `patience_s` at most (then between two
        steps, images in flight or not); the steps wait until the block ends. Raises WorkerStopped when the worker
        has ended (or is stopping)."""
        deadline = time.monotonic() + patience_s

        def stopped() -> bool:
            return self._closed or self._stopping or (self._thread.ident is not None and not self._thread.is_alive())
        while True:
            if stopped():
                raise WorkerStopped("the engine worker stopped")
            if self.outstanding == 0 or time.monotonic() >= deadline:
                self._turn_wanted.set()  # the worker lets this thread in at its next step boundary
                try:
                    while not self._turn.acquire(timeout=poll_s):
                        if stopped():
                            raise WorkerStopped("the engine worker stopped")
                finally:
                    self._turn_wanted.clear()
                if self.outstanding == 0 or time.monotonic() >= deadline:
                    break
                self._turn.release()  # an image came in meanwhile: wait on
            time.sleep(poll_s)
        try:
            yield
        finally:
            self._turn.release()

    def peak_memory_bytes(self) -> int:
        """The highest peak over the engines' runners (Runner.memory(): device memory, or the process RSS on
        CPU); 0 before any engine is built."""
        engines = [e for ladder in list(self._engines.values()) for e in list(ladder.values())]
        engines += [e for _, _, e in list(self._retiring)]
        return max((e.runner.memory().peak_bytes for e in engines), default=0)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn() in the worker thread between steps; the future resolves to what it returns (or raises what it
        raised). For work that must not run beside the steps: torch work from a second thread (turning tokens into
        images) would contend with the steps' intra-op threads for the same cores. Once the thread has ended, fn
        runs in the caller's thread."""
        future: Future = Future()
        with self._lock:
            if not self._closed:
                self._commands.put(("call", (fn, future)))
                return future
        _run_call(fn, future)
        return future

    def stop(self, timeout: Optional[float] = None) -> None:
        """Finish every admitted image, then end the thread."""
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def abandon(self) -> None:
        """Stop without finishing: every image admitted is cancelled (its future raises ShutDown) at the next turn
        of the worker, which then ends."""
        self._commands.put(("abandon", None))

    # ---- the worker thread ----
    def _run(self) -> None:
        try:
            if self.setup is not None:
                self.pipeline = self.setup()
            self._build_default()
        except BaseException as e:  # noqa: BLE001  reported by /ready and the serve command
            self.failure = e
            log.error("warm-up failed: %s", e, exc_info=True)
            self._close()
            return
        finally:
            self.ready.set()
        try:
            self._serve()
        finally:
            self._close()

    def _close(self) -> None:
        """From now on call() runs in its caller's thread; the calls already queued run here."""
        with self._lock:
            self._closed = True
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "call":
                _run_call(*payload)
            elif command == "submit":  # arrived after the stop: never started
                for job in payload:
                    self._resolve(job, error=ShutDown("the service stopped before this image started"))

    def _build_default(self) -> None:
        for width in self.widths:
            self._engine(self.default, width)

    def _serve(self) -> None:
        while not (self._stopping and not self._jobs):
            first = self._next_command(block=not self._jobs)  # waits outside the turn: another thread may take it
            while self._turn_wanted.is_set():  # it is taking the turn now (the lock favours no one)
                time.sleep(0.001)
            with self._turn:
                self._take_commands(first)
                now = time.monotonic()
                for key in self._engines:
                    self._recent_load(key).see(self.load(key), now)
                for key, width, engine in self._all_engines() + self._retiring:
                    if engine.busy or engine.waiting:
                        self._step(key, width, engine)
                self._retiring = [(k, w, e) for k, w, e in self._retiring if e.busy or e.waiting]
                busy: dict[tuple[str, str], int] = {}
                waiting = 0
                for key, width, engine in self._all_engines() + self._retiring:
                    label = (str(key), str(width))
                    busy[label] = busy.get(label, 0) + engine.busy
                    waiting += engine.waiting
                for label, count in busy.items():
                    self.metrics.slots_busy.labels(*label).set(count)
                self.metrics.queue_depth.set(waiting)

    def _all_engines(self) -> list[tuple[EngineKey, int, Engine]]:
        return [(key, width, engine) for key, ladder in self._engines.items() for width, engine in ladder.items()]

    def _switch(self, pipeline, apply: Callable[[], None]) -> None:
        """At a step boundary: the new plan, every ladder retired (its engines finish their images), the default
        ladder built on `pipeline`. Should building fail, the images keep going to the engines there are."""
        apply()
        self._retiring += [(k, w, e) for k, w, e in self._all_engines() if e.busy or e.waiting]
        for key in list(self._engines):
            self._drop(key)
        self.described.clear()
        self.pipeline = pipeline
        self.switches += 1
        try:
            self._build_default()
        except Exception as e:  # noqa: BLE001  built on first use instead (its requests then see the error)
            log.error("the default engines on the new plan failed to build: %s", e, exc_info=True)

    def load(self, key: EngineKey) -> int:
        """Images of `key` in flight or queued, over its ladder (worker thread)."""
        return sum(e.busy + e.waiting for e in self._engines.get(key, {}).values())

    def _recent_load(self, key: EngineKey) -> RecentLoad:
        return self._recent.setdefault(key, RecentLoad(self.hold_s))

    def _engine(self, key: EngineKey, width: int) -> Engine:
        """The engine for `key` at `width`, built and warmed up on first use (a new key's ladder in place of an
        idle one at the limit)."""
        ladder = self._engines.get(key)
        if ladder is not None and width in ladder:
            return ladder[width]
        if ladder is None and len(self._engines) >= self.max_engines:
            busy = {j.key for j in self._jobs.values()}
            idle = [k for k in self._engines if k not in busy and k != self.default]
            if not idle:
                raise EnginesBusy(f"this request needs an engine of its own ({key}), and all {self.max_engines} "
                                  f"engines are busy")
            self._drop(idle[0])
        dcfg, what = self.make_decode(key)
        engine = Engine(self.pipeline, dcfg, width, runner=self._runner(dcfg, width))
        engine.warm_up()  # a fused step compiles now, not in a request
        self._engines.setdefault(key, {})[width] = engine
        self.described[str(key)] = what
        self.metrics.slots.labels(str(key), str(width)).set(width)
        return engine

    def _drop(self, key: EngineKey) -> None:
        """Forget a key's ladder (its runners stay with the pipeline) and its gauges."""
        self._recent.pop(key, None)
        for width in self._engines.pop(key, {}):
            for gauge in (self.metrics.slots, self.metrics.slots_busy):
                with contextlib.suppress(KeyError):  # never set
                    gauge.remove(str(key), str(width))

    def _runner(self, dcfg, width: int):
        """The pipeline's runner for this shape (prepared and warmed up once), unless another engine uses it:
        then one of the engine's own (Pipeline.runner, not shared), so no two engines share a KV cache (engines
        of other widths have other shapes, so other runners). Either is refused before it is prepared where it
        cannot fit (MemoryRefused: the request gets 422)."""
        runner = self.pipeline.runner(dcfg, width)
        if any(e.runner is runner for _, _, e in self._all_engines() + self._retiring):
            runner = self.pipeline.runner(dcfg, width, shared=False)
        return runner

    def _next_command(self, block: bool):
        """The first command waiting (waiting up to IDLE_POLL_S for one when `block`), or None."""
        try:
            return self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return None

    def _take_commands(self, command) -> None:
        """`command` and every command waiting: a plan switch first (new requests go to the new plan), then the
        submissions together, so that a burst of requests arriving during one step is placed by its whole load,
        not one request at a time; then the cancellations (a request is always submitted before it can be
        cancelled), the calls and a stop."""
        if command is None:
            return
        taken = {"switch": [], "submit": [], "cancel": [], "call": [], "stop": [], "abandon": []}
        while True:
            taken[command[0]].append(command[1])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        for pipeline, apply in taken["switch"]:
            self._switch(pipeline, apply)
        incoming: dict[EngineKey, int] = {}  # key -> images of these submissions not yet placed
        for jobs in taken["submit"]:
            incoming[jobs[0].key] = incoming.get(jobs[0].key, 0) + len(jobs)
        for jobs in taken["submit"]:
            self._submit(jobs, incoming)
        for request_ids in taken["cancel"]:
            self._cancel(request_ids)
        for fn, future in taken["call"]:
            _run_call(fn, future)
        if taken["abandon"]:
            for rid, job in list(self._jobs.items()):
                job.engine.cancel(rid)
                self._resolve(job, error=ShutDown("the service was stopped (a second stop signal) before this "
                                                  "image finished"))
            self._jobs.clear()
        if taken["stop"] or taken["abandon"]:
            self._stopping = True

    def _submit(self, jobs: list[Job], incoming: dict) -> None:
        """One request's images: they go together to the narrowest engine of their key's ladder that fits the
        ladder's load with them and with the other requests' images arriving now (`incoming`: key -> images not
        yet placed, these included), or its recent highest load if higher."""
        key = jobs[0].key
        arriving = incoming[key]
        incoming[key] -= len(jobs)
        live = []
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                live.append(job)
            else:  # its caller gave up already
                self._resolve(job)
        if not live:
            return
        recent, now = self._recent_load(key), time.monotonic()
        recent.see(self.load(key) + arriving, now)  # at(now) is then at least this load
        width = fitting_width(self.widths, recent.at(now))
        for job in live:
            job.width = width
            try:
                job.engine = self._engine(job.key, width)
                rid = job.engine.submit(job.request)
                job.runs = (self.described[str(job.key)], self.pipeline.backend.name)  # every ladder is built on it
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
                job.engine.cancel(rid)
                self._resolve(job, error=Cancelled(rid))

    def _step(self, key: EngineKey, width: int, engine: Engine) -> None:
        try:
            report = engine.step()
        except Exception as e:  # noqa: BLE001  the engine's state is unknown: fail its images, build it anew
            log.error("engine %s (width %d) failed a step: %s\n%s", key, width, e, traceback.format_exc())
            if self._engines.get(key, {}).get(width) is engine:
                del self._engines[key][width]
            self._retiring = [r for r in self._retiring if r[2] is not engine]
            for rid in [r for r, j in self._jobs.items() if j.engine is engine]:
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
            self.ran[job.request.request_id] = job.runs
            job.future.set_result(result)


def _run_call(fn: Callable[[], object], future: Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as e:  # noqa: BLE001  the caller's to handle
        future.set_exception(e)
