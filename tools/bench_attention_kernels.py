"""The model's attention kernel, F.scaled_dot_product_attention with an additive mask, against the same product
written as two matmuls and a softmax, side by side on this CPU at the shapes the embedded model's steps have.

Shapes: (rows, query tokens) of AR, MC-SJD L=16 and chain-5 (verify 6 tokens, the drafter 1) with CFG at 1, 4
and 10 images; the embedded model's 8 heads of 32; attention over the first s cache slots (s = 70, 140, 264:
early, middle and end of an image), laid out as the model lays them out (queries transposed from (B, T, H, hd),
keys and values sliced from the preallocated cache). Both forms run in alternating order, REPEATS rounds of CALLS
calls each; reported: the median microseconds per call of each form, the matmul form's median per-round ratio to
SDPA's, and each form's largest error against a float64 reference. Writes
results/attention-kernels-cpu.{json,md}. Timing wants a quiet machine.

    python tools/bench_attention_kernels.py [--dtypes fp32 bf16] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lantern.backends.environment import cpu_description
from results_io import utc_now, write_results

ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM, CACHE_SLOTS = 8, 32, 272
STEPS = {"AR / drafter, 1 image": (2, 1), "MC-SJD L=16, 1 image": (2, 17), "AR / drafter, 4 images": (8, 1),
         "chain-5 verify, 4 images": (8, 6), "AR / drafter, 10 images": (20, 1), "chain-5 verify, 10 images": (20, 6)}
SLOTS = (70, 140, 264)
REPEATS, CALLS = 15, 40
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sdpa(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def matmuls(q, k, v, bias):
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5).add_(bias)  # (B, H, T, s)
    return torch.matmul(torch.softmax(scores, -1), v)


FORMS = {"sdpa": sdpa, "matmul": matmuls}


def inputs(rows: int, t: int, s: int, dtype: torch.dtype, gen: torch.Generator):
    """q (B, H, T, hd) as a transposed view, k and v (B, H, s, hd) sliced from a cache, causal additive bias."""
    q = torch.randn(rows, t, HEADS, HEAD_DIM, generator=gen).to(dtype).transpose(1, 2)
    k, v = (torch.randn(rows, HEADS, CACHE_SLOTS, HEAD_DIM, generator=gen).to(dtype)[:, :, :s] for _ in range(2))
    attend = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)  # the last t slots are the step's own tokens
    bias = torch.zeros(rows, 1, t, s, dtype=dtype).masked_fill(~attend, float("-inf"))
    return q, k, v, bias


def measure(rows: int, t: int, s: int, dtype: torch.dtype) -> dict:
    x = inputs(rows, t, s, dtype, torch.Generator().manual_seed(0))
    reference = sdpa(*(a.double() for a in x))
    per_call = {name: [] for name in FORMS}
    for r in range(REPEATS):
        for name in (FORMS if r % 2 == 0 else list(FORMS)[::-1]):
            fn = FORMS[name]
            fn(*x)
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn(*x)
            per_call[name].append((time.perf_counter() - t0) / CALLS)
    ratios = [m / a for m, a in zip(per_call["matmul"], per_call["sdpa"])]
    return {**{f"{name}_us": 1e6 * statistics.median(v) for name, v in per_call.items()},
            "matmul_over_sdpa": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            **{f"{name}_max_error": float((FORMS[name](*x).double() - reference).abs().max()) for name in FORMS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "attention-kernels-cpu"))
    args = ap.parse_args()
    if args.threads < 1:
        ap.error(f"--threads {args.threads} must be >= 1")
    torch.set_num_threads(args.threads)
    rows = []
    with torch.inference_mode():
        for dtype in args.dtypes:
            for step, (b, t) in STEPS.items():
                for s in SLOTS:
                    rows.append({"dtype": dtype, "step": step, "rows": b, "tokens": t, "slots": s,
                                 **measure(b, t, s, DTYPES[dtype])})
    record = {"date": utc_now(), "cpu": cpu_description(), "threads": args.threads, "torch": torch.__version__,
              "heads": HEADS, "head_dim": HEAD_DIM, "rows": rows}
    write_results(args.out, record, markdown)


def markdown(rec: dict) -> str:
    lines = [f"{rec['cpu']}, {rec['threads']} threads, torch {rec['torch']}, {rec['date']}. One attention call of "
             f"{rec['heads']} heads of {rec['head_dim']} over the first s cache slots: median microseconds of "
             "F.scaled_dot_product_attention (additive mask) and of the same product as two matmuls and a softmax, "
             "their median per-round ratio [range] (< 1: matmuls faster), and each form's largest error against "
             "float64.", "",
             "| dtype | step | rows x tokens | s | SDPA (us) | matmuls (us) | matmuls / SDPA | error SDPA "
             "| error matmuls |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        lo, hi = r["ratio_range"]
        lines.append(f"| {r['dtype']} | {r['step']} | {r['rows']} x {r['tokens']} | {r['slots']} | "
                     f"{r['sdpa_us']:.0f} | {r['matmul_us']:.0f} | {r['matmul_over_sdpa']:.2f} [{lo:.2f}-{hi:.2f}] | "
                     f"{r['sdpa_max_error']:.0e} | {r['matmul_max_error']:.0e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
