"""The memory a device has free, for the parts that size themselves by it (the engine's KV pool, the
trainer's micro-batches)."""

from __future__ import annotations

import torch

from tailrace.common import host_available_bytes


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can take without swapping or evicting: free device memory on CUDA, the
    kernel's MemAvailable (free plus reclaimable page cache) on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()
