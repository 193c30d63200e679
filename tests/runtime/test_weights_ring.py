"""The published-weights ring (runtime/weights.py) is made in shared memory directly."""

from __future__ import annotations

from multiprocessing import Pipe

import pytest
import torch

from tailrace.runtime.weights import SharedWeights, Torn, VersionGone


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


LAYOUT = (("w", (2, 3), 0), ("b", (2,), 6))


class Racing(SharedWeights):
    """A ring whose trainer publishes `version + slots` (same slot) right after each read: as a trainer
    overwriting the slot while a reader copies out of it."""

    def read(self, version: int):
        flat = super().read(version)
        self.write(version + self.slots, torch.full((8,), float(version + self.slots)))
        return flat


def test_a_slot_overwritten_or_being_overwritten_after_the_read_is_not_intact():
    ring = SharedWeights(LAYOUT, 8, torch.float32, slots=2)
    ring.write(3, torch.arange(8.0))
    flat = ring.read(3)
    assert ring.intact(3, flat) and flat.views()["b"].tolist() == [6.0, 7.0]
    ring.versions[1] = -1  # a write of version 5 has begun: the slot is marked first
    assert not ring.intact(3, flat)
    ring.write(5, torch.zeros(8))  # ... and finished
    assert not ring.intact(3, flat) and ring.intact(5, ring.read(5))


class _Engine:
    """What `_load` asks of an engine: keep what it was given."""

    def __init__(self) -> None:
        self.loaded: dict[int, dict] = {}

    def load_weights(self, state: dict, version: int) -> None:
        self.loaded[version] = {k: v.clone() for k, v in state.items()}


def test_an_engine_refuses_weights_the_trainer_overwrote_while_it_loaded_them():
    from tailrace.runtime.engine_worker import _load

    ring = SharedWeights(LAYOUT, 8, torch.float32, slots=2)
    ring.write(4, torch.full((8,), 4.0))
    engine = _Engine()
    _load(engine, ring, 4)
    assert engine.loaded[4]["w"].eq(4.0).all()
    racing = Racing(LAYOUT, 8, torch.float32, slots=2)
    racing.write(4, torch.full((8,), 4.0))
    with pytest.raises(Torn, match="version 4 were overwritten"):
        _load(engine, racing, 4)


def test_a_joined_engine_gets_a_version_over_the_wire_or_hears_it_was_torn():
    from tailrace.runtime.join import WireWeights, serve_weights

    for ring, torn in (
        (SharedWeights(LAYOUT, 8, torch.float32, slots=2), False),
        (Racing(LAYOUT, 8, slots=2), True),
    ):
        ring.write(1, torch.arange(8.0))
        driver, joined = Pipe()
        serve_weights(driver, ring)
        wire = WireWeights(joined, LAYOUT, torch.float32)
        if torn:
            with pytest.raises(Torn, match="version 1 was overwritten while it was sent"):
                wire.read(1)
        else:
            assert wire.read(1).views()["w"].flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        with pytest.raises(VersionGone):
            wire.read(7)  # never published: an empty answer
        joined.close()
