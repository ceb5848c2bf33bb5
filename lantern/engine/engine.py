"""The step engine: a static-width batch of slots over one prepared runner and one DecodeConfig, refilled from a
queue of requests as images finish (continuous batching). docs/engine.md describes the design."""
from __future__ import annotations

import itertools
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from lantern.decoding.config import DecodeConfig
from lantern.decoding.drafting import PrefixPairs
from lantern.decoding.sampling import SamplingConfig
from lantern.decoding.stats import GenerationStats
from lantern.engine.caption_mask import CaptionMaskedRunner, caption_slots_visible, drafter_caption_mask
from lantern.engine.draws import SlotDraws, check_seed, derive_seed
from lantern.engine.fused import WARM_CALLS, FusedStep
from lantern.engine.host import Conditions, Host
from lantern.engine.host_values import to_device
from lantern.engine.proposers import make_proposer
from lantern.engine.slot_sampling import SamplingOverrides, SlotSampling, request_sampling
from lantern.engine.step import Slots, StepCounts, condition_rows, decode_step, prefill
from lantern.models.family import neutral_conditions


@dataclass(frozen=True)
class Request:
    condition: object  # c2i: a class id; t2i: one caption embedding (P, C); prompt: one token row (P,)
    seed: int  # this request's own random stream
    request_id: str = ""  # echoed back; the engine assigns one if empty
    sampling: Optional[SamplingOverrides] = None
    tokens: Optional[int] = None  # stop after this many tokens; None = the whole image


@dataclass
class RequestResult:
    request_id: str
    tokens: torch.Tensor  # (tokens,) int64 on the CPU, raster order (cancelled: those decided so far)
    stats: GenerationStats  # this request's image
    submitted_s: float  # time.perf_counter() stamps
    started_s: float
    finished_s: float
    cancelled: bool = False


@dataclass
class StepReport:
    slots_busy: int  # slots holding a request during the step
    finished: list[RequestResult] = field(default_factory=list)
    drafts: int = 0  # requests that offered drafts this step
    draft_tokens: int = 0  # drafted tokens offered for verification
    accepted_tokens: int = 0  # drafted tokens accepted (bonus tokens not counted)
    accepted_per_position: list[int] = field(default_factory=list)  # requests accepting a draft at depth 1..D


@dataclass
class _Ticket:
    request: Request
    request_id: str
    limit: int
    sampling: SamplingConfig
    condition: torch.Tensor  # (1, ...) the request's condition, checked (Host.conditions)
    submitted_s: float
    started_s: float = 0.0
    cancelled: bool = False


class Engine:
    """One static-width batch of slots over one prepared runner and one DecodeConfig. Single-threaded: one
    thread owns it, and it owns its runner's caches while it has requests in flight (Pipeline.generate runs its
    own engine to completion under the pipeline's lock; a service keeps one engine per decode configuration and
    width, each width with its own runner). Every request's tokens depend on its condition and seed only, not on
    the slot, the width, the other requests or when it arrived."""

    def __init__(self, host: Host, decode: DecodeConfig, width: Optional[int], runner=None,
                 images: Optional[int] = None):
        """host: the models and what is prepared for them (lantern.engine.host.Host: a Pipeline). width: slots
        (None: the host's default). runner: (optional) a runner prepared for this shape elsewhere (a service's
        second engine of a shape, backend parity tests); default: the host's own, prepared once. images:
        (optional) how many requests it will run in all (run_batch): no more slots than those."""
        self._width = host.check(decode, width)
        if images is not None:
            self._width = min(self._width, images)
        self._decode, self.host = decode, host
        self.runner = runner if runner is not None else host.runner(decode, self._width)
        rule = host.rule(decode, self.runner)
        cfg = host.config
        self._kind = cfg.model_type  # c2i: class ids; t2i: caption embeddings; prompt: token rows
        self._t2i = self._kind == "t2i"
        cond = neutral_conditions(cfg, self._width)
        # t2i: LlamaGen's caption mask per slot (host copy, updated at refill); steps run on `_run`
        self._visible = torch.ones(self._width, cfg.cls_token_num, dtype=torch.bool) if self._t2i else None
        # prompt targets whose rows carry padding (Chameleon's unconditional row) say which prefix slots are visible
        self._prefix_visible = getattr(host.target, "prefix_visible", None)
        self._run = self.runner
        draws = SlotDraws(self._width, self.runner.device)
        self.sampling = SlotSampling(decode.sampling, self._width, self.runner.device)
        # a fused step (graph runners that have one) runs the proposer inside its one graph
        fused = self.runner.fused_steps()
        self.proposer = make_proposer(fused.inside() if fused else self.runner, decode, rule, draws, self.sampling)
        self.slots = Slots.allocate(self.runner, self._width, self.proposer.depth, cond, draws)
        self._fused = FusedStep(fused, self.proposer, self.slots) if fused else None
        self._queue: deque[_Ticket] = deque()
        self._held: list[Optional[_Ticket]] = [None] * self._width
        self._ids = itertools.count()
        self._known: set[str] = set()
        self._dropped: list[RequestResult] = []  # cancelled while queued, reported at the next step
        # each slot's root position as of the last step (host copy): a running row attends no cache slot past its
        # root plus the verify's nodes, the bound a runner may read up to (Runner.attend_until)
        self._roots = [self.runner.spec.prefix_len] * self._width
        self.steps_run = 0

    @property
    def width(self) -> int:
        return self._width

    @property
    def decode(self) -> DecodeConfig:
        return self._decode

    @property
    def busy(self) -> int:
        return sum(t is not None for t in self._held)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def submit(self, request: Request) -> str:
        """Queue a request (checked first: condition, seed, tokens, sampling); returns its id."""
        return self._enqueue(request, self._condition(request.condition))

    def _enqueue(self, request: Request, condition: torch.Tensor) -> str:
        """Queue a request whose condition is checked already ((1, ...), Host.conditions); returns its id."""
        check_seed(request.seed)
        block = self.host.config.block_size
        limit = block if request.tokens is None else request.tokens
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= block:
            raise ValueError(f"tokens {request.tokens!r} must be an integer in 1..{block}")
        sampling = request_sampling(self._decode.sampling, request.sampling)
        rid = request.request_id or f"request-{next(self._ids)}"
        if rid in self._known:
            raise ValueError(f"request_id {rid!r} is already queued or running")
        self._known.add(rid)
        self._queue.append(_Ticket(request, rid, limit, sampling, condition, time.perf_counter()))
        return rid

    def cancel(self, request_id: str) -> bool:
        """Drop a queued request, or free a running one's slot at the next step; False if unknown."""
        for t in self._queue:
            if t.request_id == request_id:
                self._queue.remove(t)
                self._known.discard(request_id)
                now = time.perf_counter()
                self._dropped.append(RequestResult(request_id, torch.zeros(0, dtype=torch.long),
                                                   GenerationStats(batch=self._width), t.submitted_s, now, now,
                                                   cancelled=True))
                return True
        for t in self._held:
            if t is not None and t.request_id == request_id:
                t.cancelled = True
                return True
        return False

    @torch.inference_mode()
    def step(self) -> StepReport:
        """Refill free slots from the queue, advance every busy slot by one step, return what finished."""
        finished, self._dropped = self._dropped, []
        self._refill()
        busy = [i for i, t in enumerate(self._held) if t is not None]
        if not busy:
            return StepReport(0, finished, accepted_per_position=[0] * self.proposer.depth)
        cancelled = [i for i in busy if self._held[i].cancelled]
        if cancelled:
            self.slots.busy[to_device(cancelled, self.runner.device)] = False
        self.runner.attend_until(self._attention_bound(busy))
        report = self._fused() if self._fused is not None else decode_step(self._run, self.proposer, self.slots)
        self.steps_run += 1
        complete = self.slots.busy & (self.slots.emitted >= self.slots.limit)
        read = torch.cat([report, complete, self.slots.root]).tolist()  # the step's one host transfer (flags as 0, 1)
        counts, rest = StepCounts.unpack(read, self.proposer.depth)
        complete, self._roots = rest[:self._width], rest[self._width:]
        done = [i for i in busy if complete[i] or self._held[i].cancelled]
        if done:
            finished += self._collect(done)
        return StepReport(len(busy), finished, counts.drafting, counts.draft_tokens, counts.accepted,
                          counts.per_depth)

    def _attention_bound(self, busy: list[int]) -> int:
        """The cache slots the coming step's running rows attend: up to the furthest root, plus the verify's
        nodes (node i sits at its slot's root + i)."""
        return max(self._roots[i] for i in busy) + max(self.runner.spec.verify_widths)

    def warm_up(self) -> None:
        """Compile a fused step now (it compiles at an engine's first steps, lantern.engine.fused), by a short
        request of a neutral condition run to completion, so that no request pays it; an engine without a fused
        step has nothing to do. Call it while the engine is idle."""
        if self._fused is None:
            return
        cfg = self.host.config
        neutral = neutral_conditions(cfg, 1)[0]
        tokens = min(cfg.block_size, (WARM_CALLS + 1) * (self.proposer.depth + 1) + 1)
        for n in range(WARM_CALLS):  # one request is enough unless its image ends within its first steps
            if self._fused.calls >= WARM_CALLS:
                break
            self.submit(Request(neutral, seed=0, request_id=f"warm-up-{n}", tokens=tokens))
            self.run()
        self.steps_run = 0  # the warm-up's steps are not the engine's work

    def run(self, progress=None, step_seconds: Optional[list] = None) -> list[RequestResult]:
        """Step until the queue and the slots are empty; results in finishing order. progress: called with
        the number of requests finished by each step. step_seconds: each step's wall seconds are appended."""
        out = []
        while self._queue or self.busy or self._dropped:
            start = time.perf_counter()
            finished = self.step().finished
            if step_seconds is not None:
                step_seconds.append(time.perf_counter() - start)
            out += finished
            if progress is not None and finished:
                progress(len(finished))
        return out

    # --- inside ---------------------------------------------------------------------------------------

    def _condition(self, condition) -> torch.Tensor:
        """One request's condition, checked -> (1,) class id, (1, P) prompt row or (1, P, C) caption."""
        if self._kind == "c2i":
            return self.host.conditions([condition]).rows
        if self._kind == "prompt":
            return self.host.conditions(torch.as_tensor(condition)[None]).rows
        return self.host.conditions(torch.as_tensor(condition, dtype=torch.float32)[None]).rows

    def _refill(self) -> None:
        free = [i for i, t in enumerate(self._held) if t is None]
        if not (free and self._queue):
            return
        ref = self.runner.engine_in_flight
        owner = ref() if ref is not None else None
        if owner is not None and owner is not self and owner.busy:
            raise RuntimeError(f"another engine has {owner.busy} requests in flight on this runner (its KV cache); "
                               f"one engine per pipeline and decode configuration at a time (docs/engine.md)")
        self.runner.engine_in_flight = weakref.ref(self)
        take = []
        while free and self._queue:
            ticket, slot = self._queue.popleft(), free.pop(0)
            ticket.started_s = time.perf_counter()
            self._held[slot] = ticket
            self._roots[slot] = self.runner.spec.prefix_len  # the prefill puts a fresh slot's root there
            take.append((slot, ticket))
        dev, s = self.runner.device, self.slots
        slots = [slot for slot, _ in take]
        idx = to_device(slots, dev)
        conds = torch.cat([t.condition for _, t in take])
        s.cond[idx] = to_device(conds, dev, s.cond.dtype)
        if self._t2i:
            self._visible[slots] = caption_slots_visible(conds)  # both on the host
            visible = self._visible.repeat(self.sampling.rows_per_image, 1)
            self._run = self.runner if visible.all() else CaptionMaskedRunner(
                self.runner, visible, drafter_caption_mask(self.host.drafter))
        s.limit[idx] = to_device([t.limit for _, t in take], dev)
        s.busy[idx] = True
        s.draws.admit(idx, to_device([t.request.seed for _, t in take], dev, torch.long))
        self.sampling.admit(idx, [t.sampling for _, t in take])
        fresh = torch.zeros(self._width, dtype=torch.bool, device=dev)
        fresh[idx] = True
        null = self.host.target.unconditional(s.cond)
        rows = condition_rows(s.cond, self._decode, null)
        if self._prefix_visible is not None:
            visible = self._prefix_visible(rows).cpu()  # (rows, P)
            self._run = self.runner if visible.all() else CaptionMaskedRunner(self.runner, visible)
        prefill(self._run, self.proposer, s, null, fresh, self._prefix_pairs(rows))

    def _prefix_pairs(self, rows: torch.Tensor) -> Optional[PrefixPairs]:
        """What the drafter pairs with the prefill's features f_0 .. f_{W-1} of condition `rows`, when it reads the
        prefix (StaticSpec.draft_prefix = W): its tokens, and the target's visible prefix slots (every one for a
        target without padded rows: LANTERN's t2i drafters read the caption unmasked)."""
        w = self.runner.spec.draft_prefix
        if not w:
            return None
        target = self.host.target
        visible = (self._prefix_visible(rows)[:, :w] if self._prefix_visible is not None
                   else torch.ones(rows.shape[0], w, dtype=torch.bool, device=rows.device))
        return PrefixPairs(self.host.drafter.prefix_tokens(target, rows), visible)

    def _collect(self, done: list[int]) -> list[RequestResult]:
        """The finished (or cancelled) slots' tokens and records: one transfer; the slots are free after."""
        s, dev = self.slots, self.runner.device
        idx = to_device(done, dev)
        rows = torch.cat([s.emitted[idx, None].double(), s.out[idx].double(), s.records.packed(idx)], 1).tolist()
        s.busy[idx] = False
        now, width, out = time.perf_counter(), s.out.shape[1], []
        for slot, row in zip(done, rows):
            t = self._held[slot]
            n = min(int(row[0]), t.limit)
            image = s.records.image_stats(row[1 + width:], n)
            out.append(RequestResult(t.request_id, torch.tensor(row[1:1 + n], dtype=torch.long),
                                     GenerationStats(images=[image], batch=self._width), t.submitted_s,
                                     t.started_s, now, cancelled=t.cancelled))
            self._held[slot] = None
            self._known.discard(t.request_id)
        return out


@dataclass
class BatchRun:
    results: list[RequestResult]  # in the order of the conditions
    stats: GenerationStats  # width, the steps' wall seconds, drafter forwards, phases, every image in order
    profile: dict  # the runner's profile record (phases, memory, warm-up)
    step_seconds: list[float] = field(default_factory=list)  # each step's wall seconds, in order


def run_batch(host: Host, decode: DecodeConfig, width: Optional[int], conditions, seed: int = 0,
              tokens: Optional[int] = None, progress=None) -> BatchRun:
    """An image of each condition (image i from derive_seed(seed, i), its first `tokens` tokens; None: all) on a fresh
    engine `width` slots wide (None: the host's default), no wider than the images, refused before its first step
    where it would not fit: Pipeline.generate's images and auto's timed runs. conditions: a Conditions the host
    checked, or the caller's (checked here). progress: called with 0 once the engine is built and fits, then with
    the requests each step finishes. Wall seconds are the steps'; a fused step's compile at the engine's first
    steps counts as preparing the runner."""
    checked = conditions if isinstance(conditions, Conditions) else host.conditions(conditions)
    engine = Engine(host, decode, width, images=len(checked))
    host.check_fits(decode, engine.width)
    if progress is not None:
        progress(0)
    runner = engine.runner
    runner.reset_times()
    runner.reset_peak_memory()
    compiled_before = runner.fused_warmup_seconds
    ids = [engine._enqueue(Request(row, derive_seed(seed, i), tokens=tokens), row[None])
           for i, row in enumerate(checked.rows)]
    t0, step_seconds = time.perf_counter(), []
    finished = {r.request_id: r for r in engine.run(progress, step_seconds)}
    wall = time.perf_counter() - t0
    compiled = runner.fused_warmup_seconds - compiled_before
    if compiled:
        host.add_prepare_seconds(runner.spec, compiled)
    results, profile = [finished[i] for i in ids], runner.profile()
    stats = GenerationStats([image for r in results for image in r.stats.images],
                            engine.steps_run * engine.proposer.drafter_calls, engine.width,
                            {k: v["total_s"] for k, v in profile["phases"].items()}, wall)
    return BatchRun(results, stats, profile, step_seconds)
