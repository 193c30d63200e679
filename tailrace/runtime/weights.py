"""Weight transfer trainer -> engines through shared memory: one contiguous buffer per version.

A ring of `slots` flat fp32 buffers lives in shared memory, created by the driver before the workers
start. The trainer writes version v into slot v % slots (one memcpy) and reports it; an engine reads
the slot back as a dict of name -> view (no copy until its own load_weights). The driver never lets a
slot be overwritten while an engine still has to load the version it holds (`max_live` check).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Names, shapes and offsets of the parameters inside one flat buffer."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> "Layout":
        names, shapes, offsets, n = [], [], [], 0
        for name, t in state.items():
            names.append(name)
            shapes.append(tuple(t.shape))
            offsets.append(n)
            n += t.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), n)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[o:o + _numel(s)].view(s) for name, s, o in zip(self.names, self.shapes, self.offsets)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class SharedWeights:
    def __init__(self, layout: Layout, slots: int = 4) -> None:
        self.layout = layout
        self.buf = torch.zeros(slots, layout.numel, dtype=torch.float32).share_memory_()
        self.versions = torch.full((slots,), -1, dtype=torch.long).share_memory_()

    @property
    def slots(self) -> int:
        return self.buf.shape[0]

    def write(self, version: int, state: dict[str, torch.Tensor]) -> None:
        slot = version % self.slots
        row = self.buf[slot]
        for name, v in self.layout.views(row).items():
            v.copy_(state[name].detach().to(torch.float32))
        self.versions[slot] = version

    def read(self, version: int) -> dict[str, torch.Tensor]:
        slot = version % self.slots
        held = int(self.versions[slot])
        if held != version:
            raise RuntimeError(f"weights of version {version} were overwritten (slot holds {held}); "
                               f"raise runtime weight slots above the number of live versions")
        return self.layout.views(self.buf[slot])
