"""Host values onto the engine's device without the host waiting. Admitting requests writes a few values per slot
(the condition, the limit, the seed, the sampling settings); a plain copy from pageable host memory makes the host
wait until the device has run everything queued before it (a synchronisation, which the GPU check counts). On CUDA
the values go through pinned memory and copy in stream order, so the host runs on; on other devices the same
non-blocking copy is an ordinary one."""
from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a list, or a tensor) as a tensor on `device`, copied without the host waiting."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if tensor.device.type == "cpu" and torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()  # the caching host allocator keeps it until the copy has run
    return tensor.to(device, non_blocking=True)
