"""The memory a device has free, for the parts that size themselves by it (the engine's KV pool, the
trainer's micro-batches)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can take without swapping or evicting: free device memory on CUDA, the
    kernel's MemAvailable (free plus reclaimable page cache) on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
