"""`BlockTable`: where each cache row's positions are, as a device tensor the backends read.

`t` (rows, width) int32: the sequence in row r keeps positions [i * block_size, (i + 1) * block_size) in
pool block t[r, i]. Rows move with the engine's slots (`move`: one row of ints, never the k/v they point
to). Entries past a row's own blocks are stale (a former owner's, or 0) but always valid block ids, so a
reader that overshoots a row's length and masks the excess (the torch backend) reads finite data.
"""

from __future__ import annotations

import torch


class BlockTable:
    def __init__(self, num_rows: int, width: int, device: torch.device | str | None = None):
        with torch.inference_mode(False):  # a plain tensor: usable in and out of inference mode
            self.t = torch.zeros(num_rows, width, dtype=torch.int32, device=device)

    @property
    def width(self) -> int:
        return self.t.shape[1]

    def set(self, row: int, blocks: list[int]) -> None:
        """A newly admitted sequence's blocks, in position order."""
        if blocks:
            self.t[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32).to(
                self.t.device, non_blocking=True
            )

    def put(self, entries: list[tuple[int, int, int]]) -> None:
        """(row, index, block) each: blocks added as sequences grew, in one write."""
        if entries:
            rows, idx, blocks = (
                torch.tensor(entries, dtype=torch.int64).to(self.t.device, non_blocking=True).unbind(1)
            )
            self.t.index_put_((rows, idx), blocks.to(torch.int32))

    def move(self, src: int, dst: int) -> None:
        self.t[dst] = self.t[src]
