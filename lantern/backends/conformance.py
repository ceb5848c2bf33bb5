"""A conformance kit for backends, in the spirit of ggml's test-backend-ops: is backend NAME right?

    from lantern.backends.conformance import check_backend
    report = check_backend("my-accel")          # or: lantern backends --check my-accel
    assert report.passed, report.failures()

It prepares small random models (GPT-test and its drafter) on the backend under test and on the torch-eager `cpu`
reference (fp32), feeds both the same random steps and compares what comes back: availability (an unavailable
backend says why), capabilities, parity per step kind and dtype (prefill, verify[1], a random tree verify[N] with
ancestor masks, commit of per-row paths read by the next step, two drafter steps) within TOLERANCE[dtype] of the
reference's largest value (TF32 fp32 within TOLERANCE["tf32"]), output ownership (base.py's output lifetime),
static shapes (at most one graph per static step at warm-up, none after, a width outside the StaticSpec refused)
and the memory report (docs/backends.md, "Writing one").
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from lantern.backends.base import DTYPES, MemoryReport, Runner, StaticSpec, StepOutput, dummy_step_inputs
from lantern.backends.registry import backend_class, get_backend
from lantern.models.config import gpt_preset
from lantern.models.drafter import Drafter
from lantern.models.gpt import GPT

TOLERANCE = {"fp32": 1e-4, "tf32": 5e-3, "bf16": 5e-2, "fp16": 1e-2}  # of the reference's largest |value|
TREE_NODES = 6  # N: root + 5 drafted nodes
DRAFT_WIDTH = 4  # W
ROUNDS = 2  # every step kind runs this often, on fresh random data each time
PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass | fail | skip
    message: str


@dataclass
class Report:
    backend: str
    available: bool
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures()

    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def to_dict(self) -> dict:
        return {"backend": self.backend, "available": self.available, "passed": self.passed,
                "checks": [dataclasses.asdict(c) for c in self.checks]}


def check_backend(name: str, dtypes: Optional[Sequence[str]] = None, seed: int = 0, **options) -> Report:
    """Every check on backend `name` (built-in or entry point), at `dtypes` (default: all it supports);
    `options` go to the backend's constructor. Raises ValueError for an unknown name."""
    cls = backend_class(name)
    avail = cls.availability()
    report = Report(name, avail.ok)
    if not avail.ok:
        said = bool(avail.reason.strip())
        report.checks.append(Check("availability", PASS if said else FAIL,
                                   avail.reason if said else "unavailable, and the reason is empty"))
        return report
    report.checks.append(Check("availability", PASS, "available"))
    backend = get_backend(name, **options)
    caps = backend.capabilities()
    bad = [d for d in caps.dtypes if d not in DTYPES]
    ok = bool(caps.device) and bool(caps.dtypes) and not bad
    report.checks.append(Check("capabilities", PASS if ok else FAIL,
                               f"device {caps.device!r}, dtypes {list(caps.dtypes)}"
                               + (f"; unknown dtypes {bad} (lantern knows {list(DTYPES)})" if bad else "")))
    for dtype in dtypes or caps.dtypes:
        report.checks += [dataclasses.replace(c, name=f"{c.name} [{dtype}]")
                          for c in DtypeChecks(backend, dtype, seed).run()]
    return report


def tiny_models(seed: int):
    """GPT-test and a drafter, random from `seed` (the caller's global RNG state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = GPT(gpt_preset("GPT-test")).eval()
        return target, Drafter(target.config).eval()


def random_parents(n: int, g: torch.Generator) -> list[int]:
    """A random tree of n nodes (parents[i] < i); nodes 1 and 2 are both children of the root, so the path to
    node 2 moves a slot when it is committed."""
    return [-1, 0, 0] + [int(torch.randint(i, (1,), generator=g)) for i in range(3, n)]


def path_to(node: int, parents: list[int]) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """(N, N) bool: node i sees node j iff j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, path_to(i, parents)] = True
    return mask


class DtypeChecks:
    """Parity, ownership, static shapes and the memory report of one backend at one dtype."""

    def __init__(self, backend, dtype: str, seed: int):
        self.backend, self.dtype, self.seed = backend, dtype, seed
        self.g = torch.Generator().manual_seed(seed)
        self.errors: dict[str, float] = {}  # step kind -> worst relative error over rounds
        self.ownership: list[str] = []  # violations
        self.kept: dict[str, tuple[StepOutput, list[torch.Tensor]]] = {}  # step -> its last outputs and a copy

    def run(self) -> list[Check]:
        target, drafter = tiny_models(self.seed)
        cfg = target.config
        widths = dict(batch=2, max_len=cfg.cls_token_num + 2 * DRAFT_WIDTH + TREE_NODES + 2,
                      prefix_len=cfg.cls_token_num, verify_widths=(1, TREE_NODES), dtype=self.dtype,
                      commit_width=TREE_NODES)
        spec = StaticSpec(**widths, draft_widths=(DRAFT_WIDTH,))
        checks = []
        try:
            runner = self.backend.prepare(target, drafter, spec)
        except Exception as e:  # noqa: BLE001  a backend without a drafter: the rest still applies
            checks.append(Check("draft parity", SKIP, f"prepare with a drafter raised {type(e).__name__}: {e}"))
            spec = StaticSpec(**widths)
            try:
                runner = self.backend.prepare(target, None, spec)
            except Exception as e:  # noqa: BLE001
                return [Check("prepare", FAIL, f"{type(e).__name__}: {e}")]
        reference = get_backend("cpu").prepare(target, drafter if spec.draft_widths else None,
                                               dataclasses.replace(spec, dtype="fp32"))
        compiled_in_warmup = count_compiled_graphs(runner.warmup)
        try:
            compiled_later = count_compiled_graphs(lambda: [self.round(runner, reference) for _ in range(ROUNDS)])
        except Exception as e:  # noqa: BLE001  a step that raises fails parity as a whole
            return checks + [Check("steps", FAIL, f"{type(e).__name__}: {e}")]
        for step in list(self.kept):  # the last outputs of every step: no call of theirs has come since
            self.check_kept(step)
        checks += self.parity_checks()
        checks.append(Check("output ownership", FAIL if self.ownership else PASS,
                            "; ".join(self.ownership[:3]) or "outputs own their memory and stay unchanged until "
                                                              "the next call of the same step"))
        if self.backend.capabilities().supports_graphs:
            checks.append(guarded("static shapes", lambda: static_shape_check(runner, compiled_in_warmup,
                                                                              compiled_later)))
        checks.append(guarded("memory report", lambda: memory_check(runner)))
        return checks

    # -- one round of every step kind, on both runners --------------------------------------------------------
    def round(self, runner: Runner, reference: Runner) -> None:
        spec, cfg, g = runner.spec, runner.model_config, self.g
        b, p, s, n = spec.batch, spec.prefix_len, spec.max_len, TREE_NODES
        slot = torch.arange(s)
        cond = torch.randint(cfg.num_classes + 1, (b,), generator=g)  # the null class included
        prefix_mask = (slot[None, :] <= torch.arange(p)[:, None]).expand(b, p, s)
        self.step("prefill", runner, reference, "prefill", cond, prefix_mask)

        tokens = torch.randint(cfg.vocab_size, (b, 1), generator=g)
        at = torch.full((b, 1), p)
        self.step("verify[1]", runner, reference, "verify", tokens, at, at.clone(), (slot <= p).expand(b, 1, s))

        r = p + 1  # committed length: the tree's root sits at slot r
        parents = random_parents(n, g)
        depth = ancestor_mask(parents).sum(1) - 1
        tree_mask = torch.zeros(n, s, dtype=torch.bool)
        tree_mask[:, :r] = True
        tree_mask[:, r:r + n] = ancestor_mask(parents)
        tokens = torch.randint(cfg.vocab_size, (b, n), generator=g)
        out = self.step(f"verify[{n}] (tree mask)", runner, reference, "verify", tokens,
                        (r + depth).expand(b, n), (r + torch.arange(n)).expand(b, n), tree_mask.expand(b, n, s))

        # each row accepts its own path (row 0 the one to node 2, whose commit moves a slot; the others a random
        # one), compacted to slots r, r+1, ...; then one AR step per row reads the compacted cache
        ends = [2] + [int(torch.randint(2, n, (1,), generator=g)) for _ in range(b - 1)]
        paths = [path_to(e, parents) for e in ends]
        src, dst = zip(*[commit_pairs(path, r, spec.commit_pairs) for path in paths])
        for run in (runner, reference):
            run.commit(torch.stack(src).to(run.device), torch.stack(dst).to(run.device))
        after = torch.tensor([[r + len(path)] for path in paths])  # (B, 1): each row's next slot
        self.step("commit (next step reads the compacted cache)", runner, reference, "verify",
                  torch.randint(cfg.vocab_size, (b, 1), generator=g), after, after.clone(),
                  slot[None, None, :] <= after[:, :, None])

        if spec.draft_widths:
            features = out.hidden[:, :DRAFT_WIDTH].float()  # the reference's, so both drafters see the same
            self.draft_round(runner, reference, features)

    def draft_round(self, runner: Runner, reference: Runner, features: torch.Tensor) -> None:
        """Two drafter steps: a chain at positions P.., then a random tree after it that reads the chain."""
        spec, cfg, g, w = runner.spec, runner.model_config, self.g, DRAFT_WIDTH
        b, p, s = spec.batch, spec.prefix_len, spec.max_len
        for start, local in ((p, torch.ones(w, w, dtype=torch.bool).tril()),
                             (p + w, ancestor_mask(random_parents(w, g)))):
            mask = torch.zeros(w, s, dtype=torch.bool)
            mask[:, p:start] = True  # the earlier pairs (drafter slots below the prefix are never written)
            mask[:, start:start + w] = local
            positions = (start + torch.arange(w)).expand(b, w)
            self.step(f"draft[{w}]", runner, reference, "draft", torch.randint(cfg.vocab_size, (b, w), generator=g),
                      features, positions, positions.clone(), mask.expand(b, w, s))

    def step(self, kind: str, runner: Runner, reference: Runner, method: str, *inputs) -> StepOutput:
        """Call `method` on both runners with the same inputs; record the parity error and check ownership.
        Returns the reference's output."""
        ref = getattr(reference, method)(*[t.contiguous() for t in inputs])
        mine = [t.clone().to(runner.device) for t in inputs]
        if method == "draft":
            mine[1] = mine[1].to(DTYPES[self.dtype])
        name = method if method == "prefill" else f"{method}[{inputs[0].shape[-1]}]"
        if name in self.kept:
            self.check_kept(name)
        out = getattr(runner, method)(*mine)
        for part, (a, e) in {"logits": (out.logits, ref.logits), "features": (out.hidden, ref.hidden)}.items():
            if a.shape != e.shape:
                self.errors[f"{kind} {part}"] = float("inf")
                continue
            scale = e.float().abs().max().clamp_min(1e-12)
            err = float((a.detach().float().cpu() - e.float()).abs().max() / scale)
            self.errors[f"{kind} {part}"] = max(self.errors.get(f"{kind} {part}", 0.0), err)
        self.keep(name, runner, out, mine)
        return ref

    def keep(self, name: str, runner: Runner, out: StepOutput, inputs: list[torch.Tensor]) -> None:
        """Check that the outputs own their memory, then keep them and a copy until the step's next call."""
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        if any(t.untyped_storage().data_ptr() in storages for t in out):
            self.ownership.append(f"{name}: an output shares memory with an input")
        copy = [t.clone() for t in out]
        for t in inputs:  # the caller may reuse its input tensors at once
            t.copy_(torch.zeros_like(t) if t.dtype != torch.bool else ~t)
        runner.sync()
        runner.memory()
        self.kept[name] = (out, copy)

    def check_kept(self, name: str) -> None:
        out, copy = self.kept.pop(name)
        if not all(torch.equal(a, b) for a, b in zip(out, copy)):
            self.ownership.append(f"{name}: outputs changed before the step's next call")

    def parity_checks(self) -> list[Check]:
        tf32 = self.dtype == "fp32" and self.backend.capabilities().fp32_matmul == "tf32"
        tol = TOLERANCE["tf32" if tf32 else self.dtype]
        kinds = dict.fromkeys(k.rsplit(" ", 1)[0] for k in self.errors)
        checks = []
        for kind in kinds:
            errs = {part: self.errors[f"{kind} {part}"] for part in ("logits", "features")}
            ok = all(e <= tol for e in errs.values())
            checks.append(Check(f"{kind} parity", PASS if ok else FAIL,
                                ", ".join(f"{part} max |out - ref| / max |ref| = {e:.2g}" for part, e in errs.items())
                                + f" (tolerance {tol:g}, {ROUNDS} rounds of random data)"))
        return checks


def commit_pairs(path: list[int], r: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) slots of one row, padded to `width` with self-copies past the new length (as the core pads)."""
    m = len(path)
    pad = r + m + torch.arange(width - m)
    return torch.cat([r + torch.tensor(path), pad]), torch.cat([r + torch.arange(m), pad])


def guarded(name: str, check: Callable[[], Check]) -> Check:
    """The check's result, or a failed check naming what it raised."""
    try:
        return check()
    except Exception as e:  # noqa: BLE001  a backend's error is a finding, not a crash of the kit
        return Check(name, FAIL, f"raised {type(e).__name__}: {e}")


def count_compiled_graphs(work: Callable[[], object]) -> int:
    """How many graphs torch.compile (dynamo) compiled while `work` ran; 0 for backends that do not use it."""
    from torch._dynamo.utils import counters  # here, not at the top: importing dynamo costs seconds
    before = counters["stats"]["unique_graphs"]
    work()
    return counters["stats"]["unique_graphs"] - before


def static_shape_check(runner: Runner, compiled_in_warmup: int, compiled_later: int) -> Check:
    steps = runner.spec.static_steps
    problems = []
    if compiled_in_warmup > len(steps):
        problems.append(f"warm-up compiled {compiled_in_warmup} graphs for {len(steps)} static steps {steps}")
    if compiled_later:
        problems.append(f"{compiled_later} graphs compiled after warm-up, over calls of the same shapes")
    width = max(runner.spec.verify_widths) + 1
    with contextlib.suppress(ValueError):
        runner.verify(*dummy_step_inputs(runner.spec, width, runner.device))
        problems.append(f"verify width {width}, outside the StaticSpec, was accepted")
    counted = (f"{compiled_in_warmup} torch.compile graphs in warm-up for {len(steps)} static steps"
               if compiled_in_warmup else "no torch.compile graphs seen (the backend captures another way)")
    return Check("static shapes", FAIL if problems else PASS, "; ".join(problems) or
                 f"{counted}, none after; a width outside the spec is refused")


def memory_check(runner: Runner) -> Check:
    report = runner.memory()
    if not isinstance(report, MemoryReport):
        return Check("memory report", FAIL, f"memory() returned {type(report).__name__}, not a MemoryReport")
    sizes = {k: v for k, v in report.to_dict().items() if k != "source"}
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0}
    problems = [f"{k} = {v!r} is not a non-negative int" for k, v in bad.items()]
    if not isinstance(report.source, str) or not report.source.strip():
        problems.append("source is empty")
    return Check("memory report", FAIL if problems else PASS,
                 "; ".join(problems) or f"peak {report.peak_bytes} bytes ({report.source})")
