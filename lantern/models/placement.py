"""Models placed on a runner's device without a second copy of their weights on the host.

`copy.deepcopy(model).to(device, dtype)` first copies every weight on the host, then converts: placing a 7B target
on a GPU would need twice its size in host memory. `placed_copy` copies the module's structure only, and each
weight straight into its place on the device, in its dtype."""
from __future__ import annotations

import copy
import itertools

import torch


def placed_copy(module: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                keep_fp32: tuple[str, ...] = ()) -> torch.nn.Module:
    """A frozen copy of `module` on `device` with its floating-point parameters and buffers in `dtype` (the others
    keep theirs, as Module.to does), the caller's module unchanged. keep_fp32: names of buffers that stay fp32
    whatever the weights' dtype (rotary tables). Each tensor is converted once, where it will live; tensors shared
    between submodules stay shared."""
    keep = {id(t) for name, t in module.named_buffers() if name.rsplit(".", 1)[-1] in keep_fp32}
    memo: dict[int, torch.Tensor] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) in memo:
            continue
        want = torch.float32 if id(t) in keep else dtype
        data = t.detach().to(device=device, dtype=want if t.is_floating_point() else None, copy=True)
        memo[id(t)] = torch.nn.Parameter(data, requires_grad=False) if isinstance(t, torch.nn.Parameter) else data
    return copy.deepcopy(module, memo).eval().requires_grad_(False)
