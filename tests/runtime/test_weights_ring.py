"""The published-weights ring (runtime/weights.py) is made in shared memory directly."""

from __future__ import annotations

import torch

from tailrace.runtime.weights import SharedWeights


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_the_ring_is_made_in_shared_memory_without_a_private_copy():
    """torch.zeros(...).share_memory_() touched a private copy of the whole ring and then its shared
    pages: the driver of a 0.6B model's run held 16 GB at start for a 9.5 GB ring. Now no page is touched
    until a version is written."""
    numel = 16 << 20  # 64 MiB a slot, 256 MiB in all
    before = _rss_mb()
    ring = SharedWeights((), numel, torch.float32, slots=4)
    assert _rss_mb() - before < 32 and ring.buf.is_shared() and ring.buf.shape == (4, numel)
    ring.write(5, torch.full((numel,), 2.0))
    assert ring.holds(5) and not ring.holds(1) and bool((ring.buf[1] == 2.0).all())
