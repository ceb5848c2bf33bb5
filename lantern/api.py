"""The stable Python API: a Pipeline holds models and a backend, prepares each static shape once, and
generates images' tokens with any decoding method, returning them with their stats and profile."""
from __future__ import annotations

import hashlib
import numbers
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from lantern.backends import Runner, get_backend
from lantern.backends.base import Backend, parse_dtype
from lantern.backends.memory import available_bytes
from lantern.backends.torch_eager import module_bytes
from lantern.decoding.config import DecodeConfig
from lantern.decoding.acceptance import Acceptance
from lantern.decoding.memory import PeakPrediction, predict_peak, refusal, widest_fitting
from lantern.decoding.sampling import SamplingConfig
from lantern.decoding.stats import GenerationStats
from lantern.engine import run_batch
from lantern.engine.host import Conditions
from lantern.engine.step import acceptance_rule, static_spec
from lantern.models.checkpoint import model_hash, weights_hash
from lantern.models.drafter import prefix_pairs
from lantern.models.text import check_encoder_fits
from lantern.plan.backend_choice import pinned_backend, plan_request, record_run
from lantern.plan.choose import Choice
from lantern.plan.validated import guarded


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (n, block_size) image tokens, raster order
    conditions: list  # class ids (c2i) or caption indices (t2i)
    stats: GenerationStats
    backend: str
    device: str
    dtype: str
    decode: DecodeConfig
    seed: int
    profile: dict = field(default_factory=dict)  # the runner's profile record (phases, memory, warm-up)
    plan: Optional[Choice] = None  # with "auto": what auto chose and ran (its pipeline, mode and plan)


def check_classes(classes: Sequence[int], num_classes: int) -> list[int]:
    if not len(classes):
        raise ValueError("no class ids given")
    out = []
    for c in classes:
        if isinstance(c, torch.Tensor) and c.dim() == 0 and not c.is_floating_point() and not c.is_complex():
            c = c.item()  # a 0-d integer tensor (e.g. an element of a tensor of class ids)
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):  # numbers.Integral: numpy's integers too
            raise ValueError(f"class id {c!r} is not an integer; allowed: integers 0..{num_classes - 1}")
        if not 0 <= c < num_classes:
            raise ValueError(f"class id {c!r} is out of range; allowed: integers 0..{num_classes - 1}")
        out.append(int(c))
    return out


DEFAULT_BATCH = 16  # images per static step unless the caller says otherwise


class ImagesBar:
    """A progress bar on stderr counting a generation's images, shown from the engine's first step on (its
    run_batch's first update): a request refused before it shows none."""

    def __init__(self, total: int, show: bool):
        self.total, self.show, self.bar = total, show, None

    def update(self, finished: int) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.total, desc="images", unit="image", disable=not self.show, file=sys.stderr)
        self.bar.update(finished)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass(frozen=True)
class ModelDefaults:
    """What a bundle says about decoding its model: validated sampling, its validated relaxations per method
    (Bundle.validations; None: no bundle's record, relaxed configs run as given), and its acceptance records by
    dtype (`--method auto`)."""

    sampling: Optional[SamplingConfig] = None
    relaxation: Optional[dict] = None
    acceptance_records: dict = field(default_factory=dict)


class Pipeline:
    """Models, a backend, and every static shape prepared once. Thread-safe by serialising: concurrent
    `generate` calls on one Pipeline run one after another (a lock held for the whole call), each with its
    own engine, so their images never mix; a thread waits while another generates."""

    def __init__(self, target, drafter=None, proximity: Optional[torch.Tensor] = None,
                 backend: str | Backend | None = None, dtype: str | None = None,
                 defaults: Optional[ModelDefaults] = None, pinned: Optional[bool] = None, **backend_options):
        """backend: a name (None: $LANTERN_BACKEND, else auto), or a Backend built already (a command line that
        checked it before loading the models). dtype None = the backend's preferred one (fp32 on CPU, bf16 on CUDA
        and HPU). `pinned`: auto plans on this backend alone; else it weighs every mode of the machine (`plan`).
        pinned None: a backend named here or in $LANTERN_BACKEND is pinned, and a Backend given is."""
        self.target, self.drafter, self.proximity = target.eval(), drafter, proximity
        self.defaults = defaults or ModelDefaults()
        if isinstance(backend, Backend) and backend_options:
            raise ValueError(f"backend options {sorted(backend_options)} are for a backend named here; the "
                             f"{backend.name} backend given is built already")
        self.backend = backend if isinstance(backend, Backend) else get_backend(backend, **backend_options)
        if pinned is None:
            pinned = isinstance(backend, Backend) or pinned_backend(backend) is not None
        self.pinned = pinned
        self._model_key: Optional[str] = None  # hashed on first use; a sibling shares it
        self._siblings: dict = {}  # (backend, dtype, options) -> the Pipeline of these models there (auto's modes)
        self.dtype = dtype or self.backend.capabilities().dtypes[0]
        self.backend.check_dtype(self.dtype)
        self.backend.check_family(self.config.family)
        drafts_for = getattr(drafter, "family", "llamagen")  # lantern's own drafters: LlamaGen's
        if drafter is not None and drafts_for != self.config.family:
            raise ValueError(f"a drafter for {drafts_for} targets was given for a {self.config.family} target (a "
                             f"drafter for another target); run a Jacobi method (sjd, mc-sjd) or AR without one")
        self._runners: dict = {}
        # StaticSpec -> seconds its runner took to prepare and warm up (compile): a fused step's compile, paid at
        # an engine's first steps (lantern.engine.fused), is added once a generation has paid it
        self.prepare_seconds: dict = {}
        self.prepare_started: dict = {}  # StaticSpec -> when (time.time()) its runner's preparation started
        self._rules: dict = {}  # (rule parameters, device) -> Acceptance, its neighbourhood built once
        self.text_encoder = None  # t2i: a lantern.models.text.T5Conditioner, so generate() takes prompts
        self.lock = threading.RLock()  # held by generate for the whole call (and by runner, release)

    @classmethod
    def from_bundle(cls, bundle, backend: str | Backend | None = None, dtype: str | None = None,
                    pinned: Optional[bool] = None, **backend_options) -> "Pipeline":
        """The bundle's models, with its validated sampling, relaxation settings and acceptance records."""
        defaults = ModelDefaults(SamplingConfig(**bundle.default_sampling), bundle.validations,
                                 bundle.acceptance_records)
        return cls(bundle.target, bundle.drafter, bundle.proximity, backend=backend, dtype=dtype, defaults=defaults,
                   pinned=pinned, **backend_options)

    def plan(self, n_images: int, sampling: Optional[SamplingConfig] = None, batch: Optional[int] = None,
             allow_relaxed: bool = False, profile=None, progress: bool = True,
             classes: Optional[Sequence[int]] = None, min_speedup: Optional[float] = None,
             prompts: Optional[torch.Tensor] = None) -> Choice:
        """`--method auto` (lantern.plan.backend_choice.plan_request): a lantern.plan.choose.Choice (the pipeline to
        run on, its mode, decode config, batch width, predictions), over every mode (`sibling` pipelines) unless
        this backend is pinned. sampling None: the bundle's. profile: a hardware profile's calibration
        (lantern.plan.calibration.ProfileCosts), else this machine's, measured once where missing. classes: the
        images' class ids in order (c2i). min_speedup: the speed-up over AR a plan needs (None: MIN_SPEEDUP).
        prompts: (n, P) prompt rows a model family's target measures its acceptance and calibration on."""
        sampling = sampling or self.defaults.sampling
        if sampling is None:
            raise ValueError("auto needs sampling settings: pass sampling=, or build the pipeline with "
                             "Pipeline.from_bundle")
        with self.lock:  # its timed runs use this pipeline's runners, as a generation does
            return plan_request(self, n_images, sampling, self.sibling, batch=batch, allow_relaxed=allow_relaxed,
                                profile=profile, progress=progress, classes=classes, min_speedup=min_speedup,
                                prompts=prompts)

    def sibling(self, backend: str, dtype: str, **backend_options) -> "Pipeline":
        """The Pipeline of these models, defaults and text encoder on another backend: built once, then reused."""
        key = (backend, dtype, tuple(sorted(backend_options.items())))
        if key not in self._siblings:
            sibling = Pipeline(self.target, self.drafter, self.proximity, backend, dtype, self.defaults,
                               **backend_options)
            sibling.text_encoder, sibling._model_key = self.text_encoder, self.model_key  # the same models
            self._siblings[key] = sibling
        return self._siblings[key]

    @property
    def config(self):
        return self.target.config

    @property
    def model_key(self) -> str:
        """The identity that acceptance records and calibrations are keyed by: target (its weights, or a family
        target's `identity`), drafter and proximity table (hashed once per pipeline and its siblings)."""
        if self._model_key is None:
            self._model_key = self._hash_models()
        return self._model_key

    def _hash_models(self) -> str:
        identity = getattr(self.target, "identity", None)  # a family target: its folder's digest (family.py)
        if identity is None:
            h = hashlib.sha256(model_hash(self.target, self.drafter).encode())
        else:
            h = hashlib.sha256(identity.encode())
            if self.drafter is not None:
                h.update(weights_hash(self.drafter.state_dict()).encode())
        if self.proximity is not None:
            h.update(self.proximity.to(torch.int64).contiguous().numpy().tobytes())  # the same key at any dtype
        return h.hexdigest()

    def spec(self, dcfg: DecodeConfig, batch: int):
        """The StaticSpec of `dcfg` at `batch` images per step (lantern.engine.step.static_spec, with the prefix
        pairs this pipeline's drafter reads)."""
        return static_spec(dcfg, self.config, batch, self.dtype, draft_prefix=prefix_pairs(self.drafter, self.config))

    def runner(self, dcfg: DecodeConfig, batch: int, shared: bool = True) -> Runner:
        """The runner for this static shape (`batch` images per step): prepared and warmed up once, then reused;
        refused before it is prepared where its predicted peak exceeds the memory available (check_fits).
        shared=False: a runner of the caller's own, prepared the same way but not kept, for an engine beside the
        one on the kept runner (no two engines share a KV cache: a service's second ladder of one shape)."""
        with self.lock:
            spec = self.spec(dcfg, batch)
            if not shared:
                return self._prepare(dcfg, batch, spec, what=f"a runner of its own at {batch} image(s) per step")
            if spec not in self._runners:
                self._runners[spec] = self._prepare(dcfg, batch, spec)
            return self._runners[spec]

    def _prepare(self, dcfg: DecodeConfig, batch: int, spec, what: str = "this request") -> Runner:
        """A runner for `spec` prepared and warmed up, its seconds recorded (prepare_seconds), refused first where
        it cannot fit beside what this process holds."""
        if spec.draft_widths and self.drafter is None:
            raise ValueError(f"drafting {dcfg.drafting!r} needs a drafter, and this pipeline has none")
        self.check_fits(dcfg, batch, what=what, new_runner=True)
        t0, self.prepare_started[spec] = time.perf_counter(), time.time()
        runner = self.backend.prepare(self.target, self.drafter if spec.draft_widths else None, spec)
        runner.warmup()
        self.prepare_seconds[spec] = time.perf_counter() - t0
        return runner

    def add_prepare_seconds(self, spec, seconds: float) -> None:
        """Count `seconds` more as preparing the runner of `spec` (a fused step's compile, paid at an engine's
        first steps)."""
        self.prepare_seconds[spec] = self.prepare_seconds.get(spec, 0.0) + seconds

    def prepared(self, dcfg: DecodeConfig, batch: int) -> bool:
        """Whether the runner for this static shape is already prepared (its compile or export paid; a fused
        step's compile included)."""
        runner = self._runners.get(self.spec(dcfg, batch))
        fused = runner.fused_steps() if runner is not None else None
        return runner is not None and (fused is None or fused.fused_warm(dcfg))

    def rule(self, dcfg: DecodeConfig, runner: Runner) -> Acceptance:
        """The acceptance rule of `dcfg` on the runner's device, built once and reused by every generation."""
        key = (dcfg.acceptance, dcfg.k, dcfg.delta, dcfg.lam, dcfg.form, str(runner.device))
        if key not in self._rules:
            self._rules[key] = acceptance_rule(dcfg, self.proximity, runner.device)
        return self._rules[key]

    def conditions(self, conditions) -> Conditions:
        """The images' conditions, checked: class ids (c2i), prompt token rows (n, P) (prompt), caption
        embeddings (n, P, C) or prompts with `text_encoder` (t2i). A Conditions is returned as it is (checked
        already)."""
        if isinstance(conditions, Conditions):
            return conditions
        if self.config.model_type == "c2i":
            return Conditions(torch.tensor(check_classes(list(conditions), self.config.num_classes),
                                           dtype=torch.long))
        if self.config.model_type == "prompt":
            rows = torch.as_tensor(conditions)
            if rows.dim() != 2 or rows.dtype != torch.long or rows.shape[1] != self.config.cls_token_num:
                raise ValueError(f"prompt conditions must be token rows of shape (n, {self.config.cls_token_num}) "
                                 f"(int64), got {tuple(rows.shape)} {rows.dtype}")
            return Conditions(rows)
        if isinstance(conditions, (list, tuple)) and conditions and all(isinstance(c, str) for c in conditions):
            if self.text_encoder is None:
                raise ValueError("prompts need a text encoder: set pipeline.text_encoder = "
                                 "lantern.models.text.T5Conditioner(folder), or pass caption embeddings")
            check_encoder_fits(self.text_encoder, self.config)
            conditions = self.text_encoder.encode(list(conditions))[0]
        cond = torch.as_tensor(conditions, dtype=torch.float32)
        want = (self.config.cls_token_num, self.config.caption_dim)
        if cond.dim() != 3 or tuple(cond.shape[1:]) != want:
            raise ValueError(f"t2i conditions must be caption embeddings of shape (n, {want[0]}, {want[1]}), "
                             f"got {tuple(cond.shape)}")
        return Conditions(cond)

    def check(self, dcfg: DecodeConfig, batch: Optional[int] = None) -> int:
        """Refuse a configuration this pipeline cannot run, before any work; returns the batch width."""
        batch = DEFAULT_BATCH if batch is None else batch
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch {batch!r} must be an integer >= 1 (images per static step)")
        if dcfg.needs_drafter and self.drafter is None:
            raise ValueError(f"method with drafting {dcfg.drafting!r} needs a drafter, and this pipeline has none "
                             f"(drafting 'jacobi', e.g. --method mc-sjd, needs none)")
        strategy = dcfg.strategy
        if strategy is not None and strategy.depth >= self.config.block_size:
            raise ValueError(f"{strategy.depth_name} {strategy.depth} must be below the image's "
                             f"{self.config.block_size} tokens")
        if dcfg.acceptance != "exact":
            Acceptance(dcfg.acceptance, k=dcfg.k, delta=dcfg.delta, lam=dcfg.lam, form=dcfg.form,
                       proximity=self.proximity)  # refuses a missing table or k beyond it
        return batch

    def predict_peak(self, dcfg: DecodeConfig, width: int, prefix: Optional[int] = None) -> PeakPrediction:
        """The predicted peak of a generation of `width` images per step with `dcfg` (lantern.decoding.memory);
        prefix: a prompt-conditioned target's prefix length to predict at instead of its own (a service's
        longest prompt)."""
        config = self.config if prefix is None else replace(self.config, cls_token_num=prefix)
        spec = static_spec(dcfg, config, width, self.dtype, draft_prefix=prefix_pairs(self.drafter, config))
        weights = module_bytes(self.target, self.drafter if spec.draft_widths else None)
        return predict_peak(dcfg, config, spec, weights, parse_dtype(self.dtype).itemsize, width)

    def check_fits(self, dcfg: DecodeConfig, width: int, what: str = "this request", new_runner: bool = False,
                   ) -> None:
        """Refuse, before any work, a generation whose predicted peak exceeds the memory available on the device
        (lantern.backends.memory.available_bytes; devices where lantern cannot tell are not checked). What this
        process already holds for it (the weights where placed, the KV cache of a prepared runner unless the
        caller prepares a `new_runner` of its own) is not asked for again. The refusal (a MemoryRefused, a
        ValueError) names the batch, top-k or method that would fit."""
        free = available_bytes(self.backend)
        if free is None:
            return
        available, source = free

        def needed(d: DecodeConfig, w: int) -> int:  # non-decreasing in w: the weights are held for every width
            predicted = self.predict_peak(d, w)
            return predicted.total_bytes - (predicted.weights_bytes if self._runners else 0)

        predicted = self.predict_peak(dcfg, width)
        held = not new_runner and self.spec(dcfg, width) in self._runners
        still = needed(dcfg, width) - (predicted.kv_cache_bytes if held else 0)
        if still > available:
            raise refusal(dcfg, width, needed, available, source, predicted, what, still=still)

    def check_ladder_fits(self, dcfg: DecodeConfig, widths: Sequence[int], shortest_prompt: Optional[int] = None,
                          ) -> None:
        """Refuse, before any work, a service whose engines cannot all fit: one runner per width held at once
        (weights once, the KV caches of every width), steps and prefills run one at a time (the widest one's
        transients), every prompt row as long as the target's prefix. The refusal names the widest --batch whose
        ladder would fit and, with `shortest_prompt` (prompt rows padded to the prefix: a service of a model
        family), the longest --max-prompt-tokens, at least that, whose ladder would."""
        free = available_bytes(self.backend)
        if free is None:
            return
        available, source = free

        def ladder(d: DecodeConfig, widest: int, prefix: Optional[int] = None) -> PeakPrediction:
            each = [self.predict_peak(d, w, prefix) for w in sorted({*(w for w in widths if w < widest), widest})]
            largest = max(each, key=lambda p: p.total_bytes - p.kv_cache_bytes)
            return replace(largest, kv_cache_bytes=sum(p.kv_cache_bytes for p in each))

        widest = max(widths)
        predicted = ladder(dcfg, widest)
        if predicted.total_bytes <= available:
            return
        fits = ()
        if shortest_prompt is not None:
            longest = widest_fitting(lambda n: ladder(dcfg, widest, n).total_bytes, self.config.cls_token_num - 1,
                                     available, least=shortest_prompt)
            fits = (f"--max-prompt-tokens {longest}",) if longest is not None else ()
        raise refusal(dcfg, widest, lambda d, w: ladder(d, w).total_bytes, available, source, predicted,
                      what=f"the service's engines at widths {sorted(widths)}", fits=fits)

    def release(self, keep: Optional[DecodeConfig] = None, batch: int = 0) -> None:
        """Free every prepared runner (its KV cache and workspaces) but the one for (keep, batch), if given; the
        next generate prepares what it needs."""
        kept = self.spec(keep, batch) if keep is not None else None
        with self.lock:
            self._runners = {spec: r for spec, r in self._runners.items() if spec == kept}

    def generate(self, conditions, dcfg: DecodeConfig | str, seed: int = 0, progress: bool = False,
                 batch: Optional[int] = None, tokens: Optional[int] = None,
                 allow_relaxed: bool = False) -> GenerationResult:
        """conditions: class ids (c2i), or caption embeddings (n, P, C) or prompts (with `text_encoder`) (t2i), or
        what `conditions()` returned for them (checked once, not again). dcfg: a DecodeConfig, or "auto" (`plan()`
        with the bundle's sampling; it runs on the pipeline auto chose, another mode's with no backend pinned, and
        the result's `plan` says which). Images run through the step
        engine `batch` slots wide (default 16): a slot whose image finishes takes the next image at the next
        step. Image i draws from its own seed `derive_seed(seed, i)` (image 0: `seed` itself), so its tokens
        do not depend on the other images, the width or the order; `generate([c_i], seed=derive_seed(seed, i))`
        reproduces it alone (same backend and dtype). With `progress`, a bar on stderr counts images.
        tokens: stop each image after its first `tokens` tokens (default: the whole image; fewer to time steps).
        On a bundle's pipeline (from_bundle), a relaxed dcfg runs relaxed only where the bundle validated it at its
        sampling, or with `allow_relaxed`; else lossless (lantern.plan.validated.guarded). `decode`: what ran.
        Concurrent calls on one Pipeline are serialised (see the class docstring)."""
        with self.lock:
            cond = self.conditions(conditions)
            c2i = self.config.model_type == "c2i"
            if isinstance(dcfg, str):
                if dcfg != "auto":
                    raise ValueError(f"decode {dcfg!r}: pass a DecodeConfig (method_preset) or 'auto'")
                choice = self.plan(len(cond), batch=batch, progress=progress,
                                   classes=cond.rows.tolist() if c2i else None, allow_relaxed=allow_relaxed)
                return replace(choice.pipeline.generate(cond, choice.decode, seed, progress, choice.width, tokens,
                                                        allow_relaxed), plan=choice)
            dcfg = guarded(dcfg, self.defaults.relaxation, self.config.vocab_size, allow_relaxed)[0]
            bar = ImagesBar(len(cond), show=progress and len(cond) > 1)
            try:
                run = run_batch(self, dcfg, batch, cond, seed, tokens, bar.update)
            finally:
                bar.close()
            if self.defaults.sampling is not None:  # a bundle's: a later auto weighs this plan on this mode
                record_run(self, dcfg, run)
            return GenerationResult(tokens=torch.stack([r.tokens for r in run.results]),
                                    conditions=cond.rows.tolist() if c2i else list(range(len(cond))), stats=run.stats,
                                    backend=self.backend.name, device=self.backend.capabilities().device,
                                    dtype=self.dtype, decode=dcfg, seed=seed, profile=run.profile)
