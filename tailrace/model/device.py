"""The memory a device has free, for the parts that size themselves by it (the engine's KV pool, the
trainer's micro-batches)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can take without swapping or evicting: on CUDA the device's free memory
    plus what torch's caching allocator holds unused (an engine's first version frees the weights it
    fuses into it); on CPU the kernel's MemAvailable (free plus reclaimable page cache)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bf16_fast(device: torch.device) -> bool:
    """Whether bf16 matrix products run at least at fp32's pace on `device`: CUDA with bf16 support,
    or a CPU oneDNN serves in bf16 (AVX-512 and up). On an AVX2-only CPU they fall to a reference
    path 7-25x slower than fp32 by shape (a warm-start step: 1.4 s against 0.12 s, ~12x, on a 2-core
    AMD EPYC)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True
