"""The engine worker's bookkeeping with a scripted engine (no model): engines per key up to the limit, an idle one
replaced, all busy refused, an engine that raises fails only its own images and is rebuilt."""
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")
from lantern.serve import worker as worker_module  # noqa: E402
from lantern.serve.metrics import ServeMetrics  # noqa: E402
from lantern.serve.worker import EngineFailed, EngineKey, EngineWorker, EnginesBusy  # noqa: E402

WAIT_S = 10


class ScriptedEngine:
    """Finishes each request after `steps_per_request` steps; raises at a step while `explode` is set."""

    explode = threading.Event()

    def __init__(self, pipeline, decode, width, runner=None):
        self.decode, self.width, self.runner = decode, width, runner
        self.queue, self.held = [], {}

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
        while self.queue and len(self.held) < self.width:
            r = self.queue.pop(0)
            self.held[r.request_id] = [r, self.decode["steps"]]
        finished = []
        for rid, entry in list(self.held.items()):
            entry[1] -= 1
            if entry[1] == 0:
                del self.held[rid]
                finished.append(SimpleNamespace(request_id=rid, cancelled=False, submitted_s=0.0, started_s=0.0,
                                                finished_s=0.0))
        time.sleep(0.005)
        return SimpleNamespace(finished=finished, drafts=0, draft_tokens=0, accepted_tokens=0,
                               accepted_per_position=[])


@pytest.fixture
def make_worker(monkeypatch):
    monkeypatch.setattr(worker_module, "Engine", ScriptedEngine)
    ScriptedEngine.explode.clear()
    pipeline = SimpleNamespace(runner=lambda dcfg, width: object(), lock=threading.RLock())
    made = []

    def make(max_engines, steps=3):
        w = EngineWorker(pipeline, lambda key: ({"steps": steps}, str(key)), EngineKey("ar"), width=2,
                         queue_limit=8, max_engines=max_engines, metrics=ServeMetrics())
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


def test_a_new_key_replaces_an_idle_engine_and_is_refused_while_all_are_busy(make_worker):
    w = make_worker(max_engines=2, steps=200)
    slow = submit(w, EngineKey("eagle2"), 1, "slow")  # the second engine, kept busy
    time.sleep(0.1)
    with pytest.raises(EnginesBusy, match="all 2 engines are busy"):
        submit(w, EngineKey("mc-sjd"), 1, "third")[0].result(WAIT_S)
    w.cancel(["slow-0"])
    with pytest.raises(worker_module.Cancelled):
        slow[0].result(WAIT_S)
    assert submit(w, EngineKey("mc-sjd"), 1, "again")[0].result(WAIT_S).request_id == "again-0"  # eagle2 replaced
    assert set(w.described) == {"ar", "eagle2", "mc-sjd"} and len(w._engines) == 2
    assert w.outstanding == 0


def test_an_engine_that_raises_fails_its_own_images_and_is_built_anew(make_worker):
    w = make_worker(max_engines=2, steps=50)
    doomed = submit(w, EngineKey("ar"), 2, "doomed")
    time.sleep(0.05)
    ScriptedEngine.explode.set()
    for f in doomed:
        with pytest.raises(EngineFailed, match="scripted failure"):
            f.result(WAIT_S)
    ScriptedEngine.explode.clear()
    assert [f.result(WAIT_S).request_id for f in submit(w, EngineKey("ar"), 2, "after")] == ["after-0", "after-1"]
    assert w.alive and w.outstanding == 0
