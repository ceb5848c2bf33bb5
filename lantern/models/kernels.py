"""Where the model may use fused kernels: the complex product of RoPE and F.rms_norm.

Eager torch on CPU or CUDA runs both natively, one kernel instead of five to ten small ones (on the embedded
model on a CPU in bf16: 9% of a 17-token verify, 2% of a one-token step). ONNX export has neither a complex
type nor an rms_norm operator, inductor generates no code for complex operators, and HPUs have no complex
dtype: there the same arithmetic runs as plain real ops. Both forms give identical results
(tests/models/test_model.py)."""
from __future__ import annotations

import torch


def fused_kernels(x: torch.Tensor) -> bool:
    return (x.device.type in ("cpu", "cuda") and not torch.onnx.is_in_onnx_export()
            and not torch.compiler.is_compiling())
