"""`BlockPool`: the KV cache's fixed-size blocks, which are free and which sequence owns which (no torch).

A sequence's positions [i * block_size, (i + 1) * block_size) live in the i-th block of its list, so a
sequence of n positions owns exactly ceil(n / block_size) blocks. Freed blocks go on top of a stack and
are handed out first, so the blocks in use stay among the recently touched ones. Misuse (allocating past
the free count, releasing what is not owned) raises: decisions about who gets blocks are `Paging`'s.
"""

from __future__ import annotations


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool({num_blocks}, {block_size}): both must be at least 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self.owned: dict[str, list[int]] = {}  # sequence id -> its blocks in position order

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` positions."""
        return -(-tokens // self.block_size)

    def short_by(self, rid: str, tokens: int) -> int:
        """Blocks `rid` (owning some or none) lacks to hold `tokens` positions."""
        return max(0, self.blocks_for(tokens) - len(self.owned.get(rid, ())))

    def allocate(self, rid: str, tokens: int) -> list[int]:
        """Give `rid` the blocks it lacks to hold `tokens` positions; returns the new ones, in order."""
        n = self.short_by(rid, tokens)
        if n > len(self._free):
            raise ValueError(f"{rid!r} needs {n} blocks, {len(self._free)} are free")
        new = [self._free.pop() for _ in range(n)]
        self.owned.setdefault(rid, []).extend(new)
        return new

    def truncate(self, rid: str, tokens: int) -> list[int]:
        """Return `rid`'s blocks past the first `tokens` positions to the pool (the one holding its
        lowest positions on top: handed out first again, as if it had never been taken)."""
        blocks = self.owned[rid]
        keep = self.blocks_for(tokens)
        freed = blocks[keep:]
        del blocks[keep:]
        self._free.extend(reversed(freed))
        return freed

    def release(self, rid: str) -> list[int]:
        """Return all of `rid`'s blocks to the pool."""
        blocks = self.owned.pop(rid)
        self._free.extend(reversed(blocks))
        return blocks
