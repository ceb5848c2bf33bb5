"""`--method auto` in a service: ready at once, planned in the background. The service serves AR on the backend
it loaded at once, and a background thread plans as `lantern generate --method auto` does, over the service's
`plan_images` (lantern.plan.backend_choice), prepares the chosen plan's runners at every width and hands the
pipeline to the engine worker, which switches at a step boundary (lantern.serve.worker). Calibration's timed runs
take turns with the steps (the worker's quiet_turn: they wait until no image is in flight, or TURN_PATIENCE_S
under constant load, and hold the steps off while they run); acceptance records and compiles run beside them.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lantern.decoding.config import DecodeConfig
from lantern.plan import calibration
from lantern.plan.candidates import AR
from lantern.serve.worker import EngineWorker, WorkerStopped

log = logging.getLogger("lantern.serve")


@dataclass(frozen=True)
class ServingPlan:
    """What auto serves: the plan's name, its decode config (the bundle's sampling), and why."""
    name: str
    decode: DecodeConfig
    why: str


def safe_plan(backend: str, sampling) -> ServingPlan:
    """AR on the backend loaded: what auto serves until its calibration has chosen."""
    return ServingPlan(AR.name, AR.decode(sampling), f"{AR.name} on {backend}: the safe plan, served from the "
                                                     f"start while auto calibrates in the background")


class BackgroundPlanner:
    """plan() -> (pipeline, ServingPlan): auto's choice, run in a thread of its own once the worker is ready, its
    timed runs in the worker's turns; then the chosen plan's runners prepared at every width of `widths`, and
    `worker.switch`. `state`: waiting, calibrating, switching, done, failed: <why> (the safe plan stays), or
    stopped. on_switch(pipeline, plan) runs in the worker thread at the step boundary of the switch."""

    def __init__(self, plan: Callable[[], tuple[object, ServingPlan]], worker: EngineWorker,
                 widths: tuple[int, ...], threads: int, on_switch: Callable[[object, ServingPlan], None],
                 on_state: Callable[[str], None] = lambda state: None):
        self.plan, self.worker, self.widths, self.threads = plan, worker, widths, threads
        self.on_switch, self.on_state = on_switch, on_state
        self.state = "waiting"
        self._thread = threading.Thread(target=self._run, name="lantern-planner", daemon=True)

    @property
    def alive(self) -> bool:
        """Its thread still runs (it may be compiling or exporting after the worker stopped)."""
        return self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self.state in ("waiting", "calibrating", "switching")

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def _set(self, state: str) -> None:
        self.state = state
        self.on_state(state)

    def _run(self) -> None:
        self.worker.ready.wait()
        if self.worker.failure is not None:
            self._set("stopped")
            return
        torch.set_num_threads(self.threads)  # the steps' count: calibration is keyed by it
        self._set("calibrating")
        try:
            with calibration.sharing_cores(self.worker.quiet_turn):
                pipe, plan = self.plan()
                for width in self.widths:  # compiles and exports here, not in the worker's switch
                    if not self.worker.alive:
                        raise WorkerStopped("the engine worker stopped")
                    calibration.compile_fused_step(pipe, plan.decode, width)
        except WorkerStopped:
            self._set("stopped")
            return
        except Exception as e:  # noqa: BLE001  the safe plan keeps serving; /ready says why
            log.error("auto's background planning failed; serving the safe plan: %s", e, exc_info=True)
            self._set(f"failed: {e}")
            return
        self._set("switching")

        def switched() -> None:
            self.on_switch(pipe, plan)
            self._set("done")
        self.worker.switch(pipe, switched)
