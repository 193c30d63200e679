"""Weight transfer trainer -> engines through shared memory: one contiguous buffer per version.

A ring of `slots` flat buffers lives in shared memory, created by the driver before the workers
start. The trainer copies its flat parameter buffer (tailrace/model/flat.py) into slot v % slots —
one memcpy — and reports version v; an engine rebuilds named views over that slot from the layout
and loads them. The driver never lets a slot be overwritten while an engine still has to load the
version it holds (the ring holds more versions than a policy keeps live). A reader checks the slot
again after copying out of it (`intact`, a seqlock's second read): a copy the trainer began to
overwrite meanwhile is refused (`Torn`), never loaded as the version it was asked for.
"""

from __future__ import annotations

import torch

from tailrace.common import Fault, one_line
from tailrace.model.flat import FlatWeights, Layout


class VersionGone(RuntimeError):
    """The weights of a version asked for are no longer where the trainer published them: newer
    versions took its place before the reader got to it (an engine that joined reads over the wire, and
    may be slow to). The engine reports it (`EngineReport.missed`) and the scheduler asks again for what
    it needs now (`Scheduler.on_load_missed`)."""


class Torn(VersionGone):
    """A version's slot was overwritten while a reader copied it out: what it copied may be half of one
    version and half of another."""


class SharedWeights:
    def __init__(
        self, layout: Layout, numel: int, dtype: torch.dtype = torch.float32, slots: int = 4
    ) -> None:
        self.layout = layout
        try:  # made in shared memory: no private copy first (a 0.6B model's fp32 ring is 9.5 GB)
            storage = torch.UntypedStorage._new_shared(slots * numel * dtype.itemsize)
        except RuntimeError as e:  # /dev/shm full or too small (docker's default is 64 MB)
            raise Fault(
                f"cannot place the weights ring ({slots} versions, {slots * numel * dtype.itemsize / 1e6:.0f} "
                f"MB) in shared memory ({one_line(e)}); free or enlarge /dev/shm (docker run --shm-size=...)"
            ) from None
        # its pages stay unmapped (zero) until a version is written into them
        self.buf = torch.empty(0, dtype=dtype).set_(storage, 0, (slots, numel))
        self.versions = torch.full((slots,), -1, dtype=torch.long).share_memory_()

    @classmethod
    def like(cls, flat: FlatWeights, slots: int = 4) -> "SharedWeights":
        return cls(flat.layout, flat.buffer.numel(), flat.buffer.dtype, slots)

    @property
    def slots(self) -> int:
        return self.buf.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.buf.dtype

    def write(self, version: int, buffer: torch.Tensor) -> None:
        slot = version % self.slots
        self.versions[slot] = -1  # a torn write is never read as valid
        self.buf[slot].copy_(buffer.detach().reshape(-1))
        self.versions[slot] = version

    def holds(self, version: int) -> bool:
        return int(self.versions[version % self.slots]) == version

    def arrivals(self) -> list[tuple[int, float, float]]:
        """Versions that reached a reader's own copy since it last asked: none, the trainer's copy into
        shared memory is the whole transfer."""
        return []

    def read(self, version: int) -> FlatWeights:
        slot = version % self.slots
        held = int(self.versions[slot])
        if held != version:
            raise VersionGone(
                f"weights of version {version} are not in shared memory (slot holds {held}); "
                f"more versions are live than the ring's {self.slots} slots"
            )
        return FlatWeights(self.buf[slot], self.layout)

    def intact(self, version: int, flat: FlatWeights) -> bool:
        """Whether `flat`, what `read(version)` handed back, still holds that version: asked after
        copying out of it. `write` marks the slot invalid before it copies, so a write that began
        during the reader's copy, finished or not, shows here."""
        return self.holds(version)
