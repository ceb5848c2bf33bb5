"""`lantern profile run`: plan the cases a hardware profile asks for, run the ones a results file does not
hold yet, and save after every case (so a stopped run resumes where it stopped). A case that raises is
recorded as failed with its error; an unavailable backend is one failed case and nothing else runs."""
from __future__ import annotations

import datetime
import gc
import inspect
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm import tqdm

from lantern.api import Pipeline
from lantern.backends import BackendUnavailable, backend_class, environment, get_backend, resolve_name
from lantern.decoding.config import method_preset
from lantern.plan import calibration, acceptance_records as records
from lantern.plan.candidates import AR, candidate_plans
from lantern.plan.choose import allowed_relaxation, runnable
from lantern.profile import measure
from lantern.profile.hardware import HardwareProfile, shipped_dir
from lantern.profile.schema import (SCHEMA, SCHEMA_VERSION, generation_case_id, load_results, save_results,
                                    step_case_id)
from lantern.profile.source import load_source

STATIC_TREE_METHODS = ("lantern++",)  # methods whose drafting is a static tree (the others draft dynamically)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass
class Case:
    id: str
    kind: str
    params: dict
    run: Callable[[], dict]


def default_results_path(profile: HardwareProfile) -> Path:
    """results/<name>.json beside the profile's file; ./results for a profile lantern ships (never inside the
    installed package) and for one built from defaults."""
    base = profile.path.parent if profile.path else Path(".")
    if base.resolve() == shipped_dir().resolve():
        base = Path(".")
    return base / "results" / f"{profile.name}.json"


def backend_options(name: str, profile: HardwareProfile) -> dict:
    """The profile's backend_options, plus `threads` for backends whose constructor takes it."""
    options = dict(profile.backend_options)
    if profile.threads and "threads" in inspect.signature(backend_class(name).__init__).parameters:
        options.setdefault("threads", profile.threads)
    return options


class Suite:
    def __init__(self, profile: HardwareProfile, backend: Optional[str] = None, model: Optional[str] = None,
                 out: Optional[Path] = None, fresh: bool = False, progress: bool = True):
        self.profile = profile
        self.requested = backend or profile.backend
        self.model_spec = model or profile.model
        self.out = Path(out) if out else default_results_path(profile)
        self.fresh = fresh
        self.progress = progress

    # -- the cases ---------------------------------------------------------------------------------------
    def plan(self) -> list[Case]:
        """Every case of the profile, in run order. Each kind of case has its planner; another kind is one more
        planner in this list (and its kind in schema.CASE_KINDS)."""
        planners = (self.step_cases, self.generation_cases, self.calibration_cases)
        return [case for planner in planners for case in planner()]

    def step_cases(self) -> list[Case]:
        """Verify latency per tree size N and drafter latency per width W, at every batch size."""
        p, src = self.profile, self.source
        cfg = src.target.config
        rows = self.sampling.rows_per_image
        cases = []
        for b in p.batch_sizes:
            for n in p.verify_sizes_at(b):
                spec = measure.step_spec(cfg, b * rows, p.dtype, verify=n)
                cases.append(Case(step_case_id("verify", b, n), "verify", {"batch": b, "rows": b * rows, "N": n},
                                  lambda spec=spec: measure.verify_latency(self.backend, src.target, spec,
                                                                           p.warmup, p.repeats)))
            if src.drafter is not None:
                for w in p.draft_sizes:
                    spec = measure.step_spec(cfg, b * rows, p.dtype, verify=1, draft=w)
                    cases.append(Case(step_case_id("draft", b, w), "draft", {"batch": b, "rows": b * rows, "W": w},
                                      lambda spec=spec: measure.draft_latency(self.backend, src.target, src.drafter,
                                                                              spec, p.warmup, p.repeats)))
        return cases

    def generation_cases(self) -> list[Case]:
        """Whole generations of B images decoded together, per batch size B, method and (static-tree methods)
        tree; AR at the same B is their baseline."""
        p = self.profile
        cases = []
        for b in p.batch_sizes:
            classes = p.classes_at(b)
            for method in p.methods:
                for tree in p.trees if method in STATIC_TREE_METHODS else [None]:
                    dcfg = method_preset(method, self.sampling, **({"drafting": tree} if tree else {}))
                    params = {"batch": b, "method": method, "tree": tree, "decode": dcfg.to_dict(),
                              "classes": classes, "seed": p.seed, "repeats": p.generation_repeats}
                    cases.append(Case(generation_case_id(b, method, tree), "generate", params,
                                      lambda dcfg=dcfg, classes=classes: measure.generation(
                                          self.make_pipe(), dcfg, classes, p.seed, p.generation_warmup,
                                          p.generation_repeats)))
        return cases

    def calibration_cases(self) -> list[Case]:
        """`--method auto`'s cost model at every batch size: one decode step of each candidate plan (relaxed
        ones included), timed with the real loop; also stored as this machine's cached calibration."""
        return [Case(f"calibration/b{b}", "calibration", {"batch": b}, lambda b=b: self._calibrate(b))
                for b in self.profile.batch_sizes]

    def _calibrate(self, width: int) -> dict:
        src, pipe = self.source, self.make_pipe()
        relaxation, _ = allowed_relaxation(True, src.relaxation, self.sampling, src.target.config.vocab_size)
        plans, _ = runnable(pipe, candidate_plans(src.drafter is not None, src.proximity is not None, relaxation),
                            self.sampling, width)
        record = records.shipped_for(src.acceptance_records, pipe.dtype)
        # a chunk of `width` images, each drawn from all the record's images of a plan
        per_chunk, attended = records.chunk_timing({name: [e["steps"]] * width
                                                    for name, e in (record or {}).get("plans", {}).items()})
        entry = calibration.measure_width(pipe, plans, self.sampling, width,
                                          {AR.name: src.target.config.block_size - 1, **per_chunk}, progress=False,
                                          attended=attended)
        model = pipe.model_key
        cached = calibration.refresh_cache(pipe, self.sampling, width, entry)
        return {**entry, "model": model, "cache": str(cached)}

    def make_pipe(self):
        """A new Pipeline per case: the runners an earlier case prepared are freed first, so each case's
        memory is its own (a Pipeline keeps every runner it prepared)."""
        gc.collect()
        src = self.source
        return Pipeline(src.target, src.drafter, src.proximity, backend=self.backend_name, dtype=self.profile.dtype,
                        **backend_options(self.backend_name, self.profile))

    # -- the file ----------------------------------------------------------------------------------------
    def header(self, backend_record: dict, model_record: dict) -> dict:
        profile = self.profile.to_dict()
        profile["settings_hash"] = self.profile.settings_hash()
        stamp = now()
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "profile": profile, "backend": backend_record,
                "model": model_record, "environment": environment.collect(),
                "provenance": environment.provenance(), "started_at": stamp,
                "updated_at": stamp, "complete": False, "cases": {}}

    def resume_or_start(self, backend_record: dict, model_record: dict) -> dict:
        fresh = self.header(backend_record, model_record)
        if self.fresh or not self.out.exists():
            return fresh
        old = load_results(self.out)
        if not old["backend"].get("available"):
            return fresh  # it recorded only that the backend was unavailable
        checks = [("settings", old["profile"].get("settings_hash"), fresh["profile"]["settings_hash"]),
                  ("backend", old["backend"].get("name"), backend_record.get("name")),
                  ("model", old["model"].get("name"), model_record.get("name"))]
        for what, was, now_ in checks:
            if was != now_:
                raise ValueError(f"{self.out} was measured with another {what} ({was!r}, now {now_!r}); pass "
                                 f"--fresh to start over or --out to write elsewhere")
        # this machine's environment and provenance; the same settings, whose names may have changed
        old.update({key: fresh[key] for key in ("environment", "provenance", "profile")})
        return old

    def setup_backend(self) -> dict:
        """Raises BackendUnavailable (or ValueError naming the valid backends for an unknown name).
        Returns the backend record of the results file."""
        p = self.profile
        if p.threads:
            torch.set_num_threads(p.threads)
        self.backend_name = resolve_name(self.requested)
        self.backend = get_backend(self.backend_name, **backend_options(self.backend_name, p))
        self.backend.check_dtype(p.dtype)
        return {"requested": self.requested, "name": self.backend_name, "available": True, "reason": "",
                "capabilities": dict(vars(self.backend.capabilities())),
                "options": backend_options(self.backend_name, p)}

    def setup_models(self) -> None:
        self.source = load_source(self.model_spec)
        self.sampling = self.profile.sampling_config(self.source.default_cfg_scale)

    def run(self) -> dict:
        p = self.profile
        try:
            backend_record = self.setup_backend()
        except (BackendUnavailable, ValueError) as e:
            return self._unavailable(str(e))
        self.setup_models()
        data = self.resume_or_start(backend_record, self.source.info)
        data["cases"].pop("backend", None)  # an earlier unavailability no longer holds
        cases = self.plan()
        todo = [c for c in cases if data["cases"].get(c.id, {}).get("status") != "ok"]
        save_results(data, self.out)
        bar = tqdm(todo, desc=f"profile {p.name}", unit="case", file=sys.stderr, disable=not self.progress)
        for case in bar:
            bar.set_postfix_str(case.id)
            data["cases"][case.id] = self._run_case(case)
            data["updated_at"] = now()
            save_results(data, self.out)
        data["complete"] = all(c.id in data["cases"] for c in cases)
        save_results(data, self.out)
        failed = [c.id for c in cases if data["cases"][c.id]["status"] == "failed"]
        return {"results": str(self.out), "profile": p.name, "backend": self.backend_name,
                "model": self.source.info["name"],
                "planned": len(cases), "ran": len(todo), "resumed": len(cases) - len(todo), "failed": failed,
                "errors": {c: data["cases"][c]["error"] for c in failed}, "complete": data["complete"],
                "available": True}

    def _run_case(self, case: Case) -> dict:
        t0 = time.perf_counter()
        record = {"kind": case.kind, "params": case.params, "measured_at": now()}
        try:
            record.update(status="ok", result=case.run())
        except Exception as e:  # noqa: BLE001  recorded, not dropped: the suite goes on with the next case
            record.update(status="failed", error=f"{type(e).__name__}: {e}",
                          traceback=traceback.format_exc(limit=4))
        record["seconds"] = time.perf_counter() - t0
        record["load_average"] = list(os.getloadavg())  # others' jobs on a shared machine skew timings: say so
        return record

    def _unavailable(self, reason: str) -> dict:
        summary = {"results": str(self.out), "profile": self.profile.name, "backend": self.requested,
                   "available": False, "reason": reason, "planned": 0, "ran": 0, "resumed": 0, "failed": ["backend"],
                   "errors": {"backend": f"unavailable: {reason}"}, "complete": True}
        if self.out.exists() and not self.fresh and load_results(self.out)["backend"].get("available"):
            return {**summary, "results_kept": "the file holds measurements from when the backend was available"}
        backend_record = {"requested": self.requested, "name": self.requested or resolve_name_or_none(),
                          "available": False, "reason": reason, "capabilities": {}, "options": {}}
        no_model = {"kind": "none", "name": None, "note": "no model loaded: the backend is unavailable"}
        data = self.header(backend_record, no_model)
        data["cases"]["backend"] = {"kind": "backend", "status": "failed", "params": {"requested": self.requested},
                                    "error": f"unavailable: {reason}", "measured_at": now(), "seconds": 0.0}
        data["complete"] = True
        save_results(data, self.out)
        return summary


def resolve_name_or_none() -> Optional[str]:
    try:
        return resolve_name(None)
    except ValueError:
        return None
