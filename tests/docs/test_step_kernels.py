"""tools/bench_step_kernels.py's count: a graph's launches, read from the code inductor generates for it (never
built), while the graph runs as dynamo traced it."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_step_kernels as tool  # noqa: E402  (a tool, beside its own helpers)


def test_a_graph_counts_its_generated_kernels_and_library_calls_and_runs_as_traced():
    code = tool.GeneratedCode()

    def f(x, w):
        y = (x @ w).relu()  # a matmul (a library call), then pointwise work
        return y.topk(2, -1).values.sum(-1) + y.softmax(-1).amax(-1)  # topk (a library call) and reductions
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    got = torch.compile(f, backend=code, fullgraph=True)(x, w)
    assert torch.allclose(got, f(x, w))  # the traced graph ran
    (generated,) = code.codes
    count = tool.launches(generated)
    assert count["extern"] == {"mm": 1, "topk": 1}, count
    assert 1 <= count["kernels"] <= 4, count  # the pointwise work and the reductions, fused into a few kernels
