"""The step engine: one decode step for every method (AR, drafter trees, Jacobi windows as proposers),
continuous batching over a static-width batch of slots, per-request seeds. docs/engine.md."""
from lantern.engine.draws import derive_seed
from lantern.engine.engine import BatchRun, Engine, Request, RequestResult, StepReport, run_batch
from lantern.engine.slot_sampling import SamplingOverrides

__all__ = ["BatchRun", "Engine", "Request", "RequestResult", "SamplingOverrides", "StepReport", "derive_seed",
           "run_batch"]
