"""Kernels per decode step of the fused step (the engine's whole step as one graph), counted in the code inductor
generates on the CPU: a count, not a timing.

On a GPU under CUDA graphs, what a step costs beyond its forward is mostly how many kernels it launches (each small
kernel a few microseconds). Inductor's scheduler, which decides what fuses into one kernel, is the same for its CPU
and GPU code, so the launches of the CPU's generated code are a fair proxy: per method preset, the fused step
(`cpu-graph`, `fused_step=True`, compiled as lantern.plan.calibration.compile_fused_step does) and the target's
forward alone at the method's verify width (the runner's verify step, compiled as the per-module graph mode does),
each counted as
- kernels: calls of the kernels inductor generated (one launch each; a kernel called twice counts twice);
- extern calls: calls the generated code makes to a library (matmuls, topk, sort, ...), by name;
and the difference, what the step launches beyond its forward. Inductor generates each graph's code exactly as
`torch.compile` does, but the code is never built (no C++ compile): the steps that compile the fused step run the
graph as dynamo traced it. The embedded bundle (or `--shape`: it inflated to LlamaGen's compute shapes), one image,
at the bundle's sampling and LlamaGen's class-to-image one (tools/samplings.py), each relaxed method at the
settings the bundle validated at that sampling. `--before FILE` puts an earlier record's counts beside these (the
same rows, matched by method and sampling). Writes results/step-kernels-cpu. Any load on the machine is fine:
nothing is timed.

    python tools/bench_step_kernels.py [--methods ar mc-sjd mc-sjd-pac:fan=60 ...] [--sampling bundle llamagen-c2i]
                                       [--dtype bf16] [--shape GPT-B] [--before results/step-kernels-cpu.json]

A method is a preset or a form of one, method:name=value:... (tools/bench_step_compression.py parse_row).
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._inductor.compile_fx import compile_fx
from torch._inductor.graph import GraphLowering

from lantern.api import Pipeline
from lantern.backends.base import dummy_step_inputs
from lantern.backends.torch_graph import MIN_RECOMPILE_LIMIT, recompile_limit_at_least
from lantern.decoding.config import METHODS as PRESETS
from lantern.models.inflate import INFLATE_SHAPES
from lantern.plan.calibration import compile_fused_step
from bench_step_compression import form_config, parse_row
from embedded_shapes import count_record
from results_io import write_results
from samplings import NAMES as SAMPLING_NAMES

ROOT = Path(__file__).resolve().parents[1]
METHODS = [m for m in PRESETS if m != "sjd"]  # SJD runs MC-SJD's step code with fresh draws: mc-sjd stands for both
KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)  # a generated kernel's definition
CALL = re.compile(r"\s*def call\(")  # the wrapper's function that runs the graph
# a library call from the wrapper: a statement that calls it, its results possibly assigned
EXTERN = re.compile(r"(?:[\w, ]+ = )?(?:extern_kernels|torch\.ops\.\w+|aten)\.(\w+)")


class GeneratedCode:
    """A torch.compile backend that has inductor generate each graph's code, keeps its wrapper code in `codes`
    (never built), and runs the graph as dynamo traced it."""

    __name__ = "inductor, code only"

    def __init__(self):
        self.codes: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        def codegen_only(graph: GraphLowering):
            wrapper, _ = graph.codegen_with_cpp_wrapper() if graph.cpp_wrapper else graph.codegen()
            self.codes.append(wrapper.value)
            return NotBuilt()
        # no cache: a cached graph would be read back whole instead of generated (and a graph never built has
        # nothing to store)
        with mock.patch.object(GraphLowering, "compile_to_module", codegen_only), \
                inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            compile_fx(copy.deepcopy(gm), example_inputs)  # inductor's passes may rewrite the graph they are given
        return gm.forward


class NotBuilt:
    """What stands for the compiled module of a graph whose code was only generated."""

    def call(self, *args):
        raise RuntimeError("generated code was counted, never built: it cannot run")


def launches(code: str) -> dict:
    """One graph's wrapper code -> {"kernels": generated kernels called, "extern": {library call: count}}, read from
    the body of its `call` function (not the kernel definitions, the checks of sizes, nor the benchmark harness)."""
    names = set(KERNEL.findall(code))
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if CALL.match(line))
    indent = len(lines[at]) - len(lines[at].lstrip())
    kernels, extern = 0, Counter()
    for line in lines[at + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break  # the end of `call`
        text = line.strip()
        called = re.match(r"(\w+)(?:\.run)?\(", text)
        if called and called.group(1) in names:
            kernels += 1
        elif EXTERN.match(text):
            extern[EXTERN.match(text).group(1)] += 1
    return {"kernels": kernels, "extern": dict(sorted(extern.items()))}


def counted(codes: list[str], what: str) -> dict:
    """The launches of the one graph compiled for `what` (more than one would be a recompile: refused)."""
    if len(codes) != 1:
        raise RuntimeError(f"{what} compiled {len(codes)} graphs, expected one")
    return launches(codes[0])


def step_launches(pipe: Pipeline, dcfg, code: GeneratedCode) -> dict:
    """The fused step's launches (its runner prepared first, so only the step compiles meanwhile)."""
    pipe.runner(dcfg, 1)
    start = len(code.codes)
    compile_fused_step(pipe, dcfg, 1)
    return counted(code.codes[start:], "the fused step")


def forward_launches(pipe: Pipeline, dcfg, code: GeneratedCode) -> dict:
    """The target's forward alone at the verify width: the runner's verify step compiled by itself."""
    runner = pipe.runner(dcfg, 1)
    start = len(code.codes)
    with recompile_limit_at_least(MIN_RECOMPILE_LIMIT):
        runner.verify(*dummy_step_inputs(runner.spec, dcfg.verify_width, runner.device))
    return counted(code.codes[start:], "the verify step")


def calls(count: dict) -> int:
    return count["kernels"] + sum(count["extern"].values())


def row(models, dtype: str, method: str, sampling_name: str, dcfg) -> dict:
    """One method's counts, on a pipeline of its own (dynamo starts afresh: nothing compiled before is reused)."""
    torch._dynamo.reset()
    code = GeneratedCode()
    pipe = Pipeline(*models, backend="cpu-graph", dtype=dtype, fused_step=True, compiler=code)
    step, forward = step_launches(pipe, dcfg, code), forward_launches(pipe, dcfg, code)
    pipe.release()
    extern_beyond = Counter(step["extern"])
    extern_beyond.subtract(forward["extern"])
    return {"method": method, "sampling": sampling_name, "verify_width": dcfg.verify_width,
            "decode": dcfg.to_dict(), "step": step, "forward": forward,
            "beyond_forward": {"kernels": step["kernels"] - forward["kernels"],
                               "extern": {k: v for k, v in sorted(extern_beyond.items()) if v},
                               "calls": calls(step) - calls(forward)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=METHODS, help="presets or forms (default: %(default)s)")
    ap.add_argument("--sampling", nargs="+", default=list(SAMPLING_NAMES), choices=SAMPLING_NAMES)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--shape", default="embedded", choices=["embedded", *sorted(INFLATE_SHAPES)],
                    help="the embedded model, or it inflated to a LlamaGen compute shape")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--before", help="an earlier record of this tool, shown beside this one")
    ap.add_argument("--counted", help="an earlier record of this tool whose rows are taken as counted there (its "
                    "provenance kept), instead of counting again: e.g. to show it beside --before")
    ap.add_argument("--out", help="output stem (default results/step-kernels-cpu)")
    args = ap.parse_args()
    unknown = sorted({parse_row(m)[0] for m in args.methods} - set(METHODS))  # refused before any work
    if unknown:
        ap.error(f"unknown method {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle, (target, drafter, proximity), settings, record = count_record(args.shape, args.dtype, args.sampling,
                                                                          args.before)
    if args.counted:
        counted = json.loads(Path(args.counted).read_text())
        record.update({key: counted[key] for key in ("date", "dtype", "shape", "torch", "samplings", "rows")},
                      counted=counted["provenance"])
        write_results(args.out or ROOT / "results" / "step-kernels-cpu", record, markdown)
        return
    for name, sampling in settings.items():
        relaxation = bundle.relaxation_at(sampling)
        for method in args.methods:
            dcfg = form_config(method, sampling, relaxation)
            record["rows"].append(row((target, drafter, proximity), args.dtype, method, name, dcfg))
            write_results(args.out or ROOT / "results" / "step-kernels-cpu", record, markdown)  # after every row


def extern_text(extern: dict) -> str:
    return ", ".join(f"{name} {n}" for name, n in extern.items()) or "-"


def markdown(rec: dict) -> str:
    before = {(r["method"], r["sampling"]): r for r in rec.get("before", {}).get("rows", [])}
    lines = [f"Launches per decode step of the fused step (`cpu-graph`, `fused_step=True`), counted in inductor's "
             f"generated CPU code (torch {rec['torch']}): the {rec['shape']} model, {rec['dtype']}, one image. "
             f"Samplings: " + "; ".join(f"{n}: {d}" for n, d in rec["samplings"].items()) + ". Kernels: generated "
             "kernels called; calls: kernels and library (extern) calls together; forward: the target's forward "
             "alone at the verify width; beyond: the step's launches less the forward's."]
    if "counted" in rec:
        lines[0] += f" Counted at commit {rec['counted']['commit']} (`{rec['counted']['command']}`)."
    if before:
        lines[0] += f" Before: commit {rec['before']['commit']}; after: this record's (x -> y where they differ)."
    lines += ["", "| sampling | method | verify width | step kernels | step calls | forward kernels | forward calls "
                  "| beyond: kernels | beyond: calls | extern calls beyond the forward |",
              "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r: dict, old: dict | None, get) -> str:
        new = get(r)
        return str(new) if old is None or get(old) == new else f"{get(old)} -> {new}"
    for r in rec["rows"]:
        old = before.get((r["method"], r["sampling"]))
        lines.append(f"| {r['sampling']} | {r['method']} | {r['verify_width']} "
                     f"| {cell(r, old, lambda x: x['step']['kernels'])} | {cell(r, old, lambda x: calls(x['step']))} "
                     f"| {cell(r, old, lambda x: x['forward']['kernels'])} "
                     f"| {cell(r, old, lambda x: calls(x['forward']))} "
                     f"| {cell(r, old, lambda x: x['beyond_forward']['kernels'])} "
                     f"| {cell(r, old, lambda x: x['beyond_forward']['calls'])} "
                     f"| {extern_text(r['beyond_forward']['extern'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
