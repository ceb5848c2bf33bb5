"""The engine worker's bookkeeping with a scripted engine (no model): engines per key up to the limit, an idle one
replaced, all busy refused, an engine that raises fails only its own images and is rebuilt, and new images taking
the narrowest width of the ladder that fits the load, without moving images in flight."""
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")
from lantern.serve import worker as worker_module  # noqa: E402
from lantern.serve.metrics import ServeMetrics  # noqa: E402
from lantern.serve.worker import EngineFailed, EngineKey, EngineWorker, EnginesBusy, ShutDown  # noqa: E402

WAIT_S = 60  # a bound for a wait that hangs, not a speed: every wait below ends on what it waits for


class ScriptedEngine:
    """Finishes each request after `steps_per_request` steps; raises at a step while `explode` is set; while `hold`
    is set, an image stops short of its last step, so it stays in flight until the test clears `hold` (whatever the
    machine's speed). Counts its steps."""

    explode = threading.Event()
    hold = threading.Event()

    def __init__(self, pipeline, decode, width, runner=None):
        self.pipeline, self.decode, self.width, self.runner = pipeline, decode, width, runner
        self.queue, self.held = [], {}
        self.warmed = False
        self.steps_taken = 0

    def warm_up(self):
        assert not (self.queue or self.held), "warmed up while it had work"
        self.warmed = True

    @property
    def busy(self):
        return len(self.held)

    @property
    def waiting(self):
        return len(self.queue)

    def submit(self, request):
        self.queue.append(request)
        return request.request_id

    def cancel(self, request_id):
        self.queue = [r for r in self.queue if r.request_id != request_id]
        return self.held.pop(request_id, None) is not None

    def step(self):
        if self.explode.is_set():
            raise RuntimeError("scripted failure")
        self.steps_taken += 1
        while self.queue and len(self.held) < self.width:
            r = self.queue.pop(0)
            self.held[r.request_id] = [r, self.decode["steps"]]
        finished = []
        for rid, entry in list(self.held.items()):
            if entry[1] == 1 and self.hold.is_set():
                continue
            entry[1] -= 1
            if entry[1] == 0:
                del self.held[rid]
                finished.append(SimpleNamespace(request_id=rid, cancelled=False, submitted_s=0.0, started_s=0.0,
                                                finished_s=0.0, width=self.width))
        time.sleep(0.005)
        return SimpleNamespace(finished=finished, drafts=0, draft_tokens=0, accepted_tokens=0,
                               accepted_per_position=[])


@pytest.fixture
def make_worker(monkeypatch):
    monkeypatch.setattr(worker_module, "Engine", ScriptedEngine)
    ScriptedEngine.explode.clear()
    ScriptedEngine.hold.clear()
    pipeline = SimpleNamespace(runner=lambda dcfg, width: object(), backend=SimpleNamespace(name="scripted"))
    made = []

    def make(max_engines, steps=3, widths=(2,), hold_s=0.0, pipeline=pipeline):
        w = EngineWorker(pipeline, lambda key: ({"steps": steps}, str(key)), EngineKey("ar"), widths=widths,
                         queue_limit=8, max_engines=max_engines, metrics=ServeMetrics(), hold_s=hold_s)
        w.start()
        assert w.ready.wait(WAIT_S) and w.failure is None
        made.append(w)
        return w
    yield make
    for w in made:
        w.stop(WAIT_S)


def submit(w, key, n, tag):
    assert w.admit(n)
    return w.submit(key, [SimpleNamespace(request_id=f"{tag}-{i}") for i in range(n)])


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {WAIT_S} s"
        time.sleep(0.005)


def engine_of(w, key, width):
    """The engine of `key` at `width`, once the worker has built it (None before)."""
    return w._engines.get(key, {}).get(width)


def in_flight(w, key, width, n: int) -> bool:
    engine = engine_of(w, key, width)
    return engine is not None and engine.busy == n


def test_a_new_key_replaces_an_idle_engine_and_is_refused_while_all_are_busy(make_worker):
    w = make_worker(max_engines=2, steps=3)
    ScriptedEngine.hold.set()
    slow = submit(w, EngineKey("eagle2"), 1, "slow")  # the second engine, kept busy
    wait_for(lambda: in_flight(w, EngineKey("eagle2"), 2, 1), "eagle2 image in flight")
    with pytest.raises(EnginesBusy, match="all 2 engines are busy"):
        submit(w, EngineKey("mc-sjd"), 1, "third")[0].result(WAIT_S)
    w.cancel(["slow-0"])
    with pytest.raises(worker_module.Cancelled):
        slow[0].result(WAIT_S)
    ScriptedEngine.hold.clear()
    assert submit(w, EngineKey("mc-sjd"), 1, "again")[0].result(WAIT_S).request_id == "again-0"  # eagle2 replaced
    assert set(w.described) == {"ar", "eagle2", "mc-sjd"} and len(w._engines) == 2
    assert ("lantern:slots", (("engine", "eagle2"), ("width", "2"))) not in samples(w)  # its gauges went with it
    assert w.outstanding == 0


class OneShapePipeline:
    """Keeps one runner for every shape; a runner of a caller's own (shared=False) is a new one each time."""

    backend = SimpleNamespace(name="scripted")

    def __init__(self):
        self.kept, self.own = object(), []

    def runner(self, dcfg, width, shared=True):
        if shared:
            return self.kept
        self.own.append(object())
        return self.own[-1]


def test_a_second_engine_of_a_shape_gets_a_runner_of_its_own_from_the_pipeline(make_worker):
    """One way to prepare a runner: an engine of another key on a shape whose kept runner the default engine holds
    gets a runner of its own from Pipeline.runner (shared=False), as the library's runners come, not prepared by the
    worker beside it; and the worker steps without the pipeline's lock (this pipeline has none)."""
    pipe = OneShapePipeline()
    w = make_worker(max_engines=2, pipeline=pipe)
    other = EngineKey("ar", (("top_k", 3),))
    assert submit(w, other, 1, "own")[0].result(WAIT_S).request_id == "own-0"
    assert w._engines[EngineKey("ar")][2].runner is pipe.kept
    assert len(pipe.own) == 1 and w._engines[other][2].runner is pipe.own[0]


def test_an_engine_that_raises_fails_its_own_images_and_is_built_anew(make_worker):
    w = make_worker(max_engines=2, steps=3)
    ScriptedEngine.hold.set()
    doomed = submit(w, EngineKey("ar"), 2, "doomed")
    wait_for(lambda: in_flight(w, EngineKey("ar"), 2, 2), "both images in flight")
    ScriptedEngine.explode.set()
    for f in doomed:
        with pytest.raises(EngineFailed, match="scripted failure"):
            f.result(WAIT_S)
    ScriptedEngine.explode.clear()
    ScriptedEngine.hold.clear()
    assert [f.result(WAIT_S).request_id for f in submit(w, EngineKey("ar"), 2, "after")] == ["after-0", "after-1"]
    assert w.alive and w.outstanding == 0


def test_abandon_fails_the_images_in_flight_and_later_ones_at_once(make_worker):
    """A second stop signal: every image admitted raises ShutDown, the thread ends without finishing them, and an
    image submitted afterwards is answered at once instead of waiting for a thread that is gone."""
    w = make_worker(max_engines=1, steps=3)
    ScriptedEngine.hold.set()
    running = submit(w, EngineKey("ar"), 4, "running")
    wait_for(lambda: in_flight(w, EngineKey("ar"), 2, 2) and engine_of(w, EngineKey("ar"), 2).waiting == 2,
             "2 images decoding, 2 queued")
    w.abandon()
    for f in running:
        with pytest.raises(ShutDown, match="stopped"):
            f.result(WAIT_S)
    w._thread.join(WAIT_S)
    assert not w.alive and w.outstanding == 0
    with pytest.raises(ShutDown, match="before this image started"):
        submit(w, EngineKey("ar"), 1, "late")[0].result(WAIT_S)
    assert w.outstanding == 0


def samples(w) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(w.metrics.render().decode()) for s in family.samples}


def test_new_images_take_the_narrowest_width_that_fits_the_load_and_never_move(make_worker):
    assert [worker_module.fitting_width((1, 4, 16), n) for n in (1, 2, 4, 5, 16, 40)] == [1, 4, 4, 16, 16, 16]
    w = make_worker(max_engines=1, steps=3, widths=(1, 4))
    ar = EngineKey("ar")
    assert sorted(w._engines[ar]) == [1, 4]  # the default ladder is built before ready
    assert all(e.warmed for e in w._engines[ar].values())  # and warmed up (a fused step compiles then)
    ScriptedEngine.hold.set()
    alone = submit(w, ar, 1, "alone")  # load 1: the width-1 engine
    wait_for(lambda: in_flight(w, ar, 1, 1), "the first image in flight")
    more = submit(w, ar, 2, "more")  # load 3 with the one in flight: width 4; the first stays where it is
    wait_for(lambda: in_flight(w, ar, 4, 2), "the next two in flight")
    ScriptedEngine.hold.clear()
    assert alone[0].result(WAIT_S).width == 1
    assert [f.result(WAIT_S).width for f in more] == [4, 4]
    burst = submit(w, ar, 5, "burst")  # more than the widest: the widest, one image queued there
    assert [f.result(WAIT_S).width for f in burst] == [4] * 5
    assert submit(w, ar, 1, "later")[0].result(WAIT_S).width == 1  # the load fell: narrow again
    got = samples(w)
    assert got[("lantern:slots", (("engine", "ar"), ("width", "1")))] == 1
    assert got[("lantern:slots", (("engine", "ar"), ("width", "4")))] == 4
    assert got[("lantern:slots_busy", (("engine", "ar"), ("width", "4")))] == 0
    assert w.outstanding == 0


def test_a_burst_arriving_during_a_step_is_placed_by_its_whole_load(make_worker):
    """Requests that arrive while the worker steps are placed together: with one image in flight, four more
    arriving at once fit width 16 only, so all four go there (one at a time they would split: 4, 4, 4, 16)."""
    w = make_worker(max_engines=1, steps=3, widths=(1, 4, 16))
    ar = EngineKey("ar")
    ScriptedEngine.hold.set()
    first = submit(w, ar, 1, "first")
    wait_for(lambda: in_flight(w, ar, 1, 1), "the first image in flight")
    with w.quiet_turn(patience_s=0):  # the worker waits for it at its next step; the burst queues meanwhile
        burst = [submit(w, ar, 1, f"burst{i}")[0] for i in range(4)]
    wait_for(lambda: in_flight(w, ar, 16, 4), "the burst in flight")
    ScriptedEngine.hold.clear()
    assert [f.result(WAIT_S).width for f in burst] == [16] * 4
    assert first[0].result(WAIT_S).width == 1


def test_prompts_waiting_while_the_encoder_is_busy_are_encoded_together_up_to_its_batch():
    from lantern.serve.prompts import PromptBatcher
    first_call, release, calls = threading.Event(), threading.Event(), []

    class Encoder:
        def encode(self, prompts, batch):
            calls.append((list(prompts), batch))
            first_call.set()
            assert release.wait(WAIT_S)
            return [f"caption of {p}" for p in prompts], None

    batcher = PromptBatcher(Encoder(), batch=2)
    futures = [batcher.encode("a")]
    assert first_call.wait(WAIT_S)
    futures += [batcher.encode(p) for p in "bcd"]  # they wait while "a" is encoded
    release.set()
    assert [f.result(WAIT_S) for f in futures] == [f"caption of {p}" for p in "abcd"]
    assert calls == [(["a"], 2), (["b", "c"], 2), (["d"], 2)]
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.encode("e")


def test_clients_coming_back_within_the_hold_land_on_the_width_they_left(make_worker, monkeypatch):
    """A load of 4 that just finished still places the next image at width 4 (its client coming back for the next
    one); once the hold has passed with nothing in flight, a request alone runs at width 1 again. The worker's
    clock is the test's, so "within the hold" does not depend on how fast a busy machine runs the test."""
    hold_s, now = 1.0, [0.0]
    monkeypatch.setattr(worker_module, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=time.sleep))
    w = make_worker(max_engines=1, steps=5, widths=(1, 4, 16), hold_s=hold_s)
    ar = EngineKey("ar")
    assert [f.result(WAIT_S).width for f in submit(w, ar, 4, "four")] == [4] * 4
    assert submit(w, ar, 1, "back")[0].result(WAIT_S).width == 4
    now[0] += hold_s + 0.2
    assert submit(w, ar, 1, "alone")[0].result(WAIT_S).width == 1
    assert w.outstanding == 0


def test_recent_load_keeps_the_highest_load_for_its_hold():
    recent = worker_module.RecentLoad(hold_s=2.0)
    recent.see(16, now=10.0)
    recent.see(3, now=11.0)
    assert recent.at(11.5) == 16  # fell within the hold: the highest still counts
    recent.see(16, now=11.9)
    assert recent.at(13.5) == 16  # seen again: held from then
    assert recent.at(14.0) == 0  # nothing seen for longer than the hold
    recent.see(2, now=14.0)
    assert recent.at(14.0) == 2


def test_calls_run_in_the_worker_thread_between_steps_and_inline_once_it_has_ended(make_worker):
    w = make_worker(max_engines=1, steps=3, widths=(2,))
    ScriptedEngine.hold.set()  # running still when the test looks, however busy the machine
    running = submit(w, EngineKey("ar"), 2, "running")
    wait_for(lambda: in_flight(w, EngineKey("ar"), 2, 2), "both images in flight")
    where = w.call(threading.current_thread).result(WAIT_S)
    assert where is w._thread  # not the caller's, not a pool's: no torch work beside the steps
    assert not any(f.done() for f in running)  # ran between two steps of images still in flight
    with pytest.raises(ZeroDivisionError):
        w.call(lambda: 1 / 0).result(WAIT_S)  # what it raised reaches the caller
    ScriptedEngine.hold.clear()
    assert all(f.result(WAIT_S).width == 2 for f in running)
    w.stop(WAIT_S)
    assert not w.alive
    assert w.call(threading.current_thread).result(0) is threading.current_thread()


def test_a_quiet_turn_waits_for_the_images_in_flight_and_holds_the_steps_off(make_worker):
    """Another thread's turn (a background calibration's timed runs) starts only once no image is admitted, and
    no step runs while it lasts: neither shares the cores with the other."""
    w = make_worker(max_engines=1, steps=20, widths=(2,))
    running = submit(w, EngineKey("ar"), 1, "running")  # 20 steps of at least 5 ms
    entered = threading.Event()

    def take_turn():
        with w.quiet_turn():
            entered.set()
            assert running[0].done()  # the turn came after the image in flight
            held = submit(w, EngineKey("ar"), 1, "held")
            time.sleep(0.2)  # long enough for several steps, had the worker stepped
            assert not held[0].done()
            assert w._engines[EngineKey("ar")][2].busy == 0  # submitted, not stepped
        assert held[0].result(WAIT_S).request_id == "held-0"
    taker = threading.Thread(target=take_turn)
    taker.start()
    taker.join(WAIT_S)
    assert entered.is_set() and not taker.is_alive()
    w.stop(WAIT_S)
    with pytest.raises(worker_module.WorkerStopped):  # a planner waiting on a stopped worker gives up
        with w.quiet_turn():
            pass


def test_calibration_does_not_count_the_seconds_it_waits_for_a_turn(monkeypatch):
    """measure_width under sharing_cores: the waits (here 1000 s of a fake clock per turn) count neither against
    the timing budget nor in the entry's seconds, so the same plans are timed as many times as without waits."""
    import contextlib

    from test_auto import SAMPLING, CostCurvePipe, run_on_fakes

    from lantern.plan import calibration
    from lantern.plan.candidates import AR, candidate_plans
    run_on_fakes(monkeypatch)
    plans = candidate_plans(True, False)
    per_chunk = {p.name: (63.0 if p == AR else 31.5) for p in plans}

    def calibrate(sharing: bool) -> tuple[dict, dict, int]:
        pipe = CostCurvePipe(lambda width, drafts: 20.0 * (1 + width / 16))
        turns = []

        @contextlib.contextmanager
        def turn():
            pipe.now += 1000.0  # waited for the service to have no image
            turns.append(pipe.now)
            yield
        with calibration.sharing_cores(turn) if sharing else contextlib.nullcontext():
            entry = calibration.measure_width(pipe, plans, SAMPLING, 1, per_chunk, progress=False, clock=pipe.clock)
        return entry, {n: len(v.get("ratio_to_ar", [])) for n, v in entry["plans"].items()}, len(turns)

    alone, runs_alone, _ = calibrate(sharing=False)
    shared, runs_shared, turns = calibrate(sharing=True)
    assert turns >= 1 + sum(runs_shared.values())  # the fixed-cost runs, then each plan's run with its reference
    assert runs_shared == runs_alone and max(runs_alone.values()) > 1
    assert shared["seconds"] == pytest.approx(alone["seconds"]) and shared["seconds"] < calibration.BUDGET_S


def test_a_quiet_turn_comes_between_two_steps_when_the_service_never_idles(make_worker):
    """Under constant load a turn waits `patience_s` at most, then comes between two steps: the image in flight
    is held (not stepped) while the turn lasts, and finishes after it."""
    w = make_worker(max_engines=1, steps=3, widths=(2,))
    ScriptedEngine.hold.set()  # in flight until the test clears it: the service never idles
    running = submit(w, EngineKey("ar"), 1, "running")
    engine = w._engines[EngineKey("ar")][2]
    wait_for(lambda: engine.held, "the image in flight")
    with w.quiet_turn(patience_s=0.2):
        assert not running[0].done()
        taken = engine.steps_taken
        time.sleep(0.2)
        assert engine.steps_taken == taken  # not stepped during the turn
    ScriptedEngine.hold.clear()
    assert running[0].result(WAIT_S).request_id == "running-0"
