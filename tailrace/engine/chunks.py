"""Attention chunks: split a decode group's rows so each part attends only as far as its longest row.

A batched attention over rows [lo, hi) reads every row's cache up to S = (max position in it) + 1,
so one long straggler makes a whole batch of short rows pay for its length. With rows kept sorted by
position (longest first), cutting them into a few contiguous chunks, each with its own S, brings the
work back to about the sum of the rows' own lengths. Each extra chunk costs a few more ops per layer,
counted here as `CHUNK_COST` row-positions. Pure Python: the host knows every position.

Rows drift out of order as finished rows are refilled by the newest (shortest) ones; `needs_sort`
says when re-sorting the group (a row permutation, see `Slots.reorder`) pays off.
"""

from __future__ import annotations

CHUNK_COST = 96  # ~ the op overhead of one more chunk, in row-positions of attention (measured, CPU)
BLOCK = 4  # chunk boundaries fall on multiples of this many rows
SORT_SLACK = 1.25  # re-sort when chunked work exceeds the ideal by this factor ...
SORT_EVERY = 8  # ... and at least this many steps passed since the last sort

# (lo, hi, S, first): rows [lo, hi) of the group attend to positions [0, S); `first`, the lowest position among
# them, tells a windowed layer's attention where the first row's window starts (a 3-tuple: from 0)
Chunk = tuple[int, ...]


def plan(positions: list[int]) -> list[Chunk]:
    """Chunks for rows at these positions (in row order), minimizing sum(rows * S) + CHUNK_COST per
    chunk over boundaries on multiples of BLOCK (dynamic programming over <= n/BLOCK blocks)."""
    n = len(positions)
    top = max(positions) + 1
    if n <= BLOCK or top * n - sum(positions) - n <= CHUNK_COST:  # one chunk wastes too little to cut
        return [(0, n, top, min(positions))]
    edges = list(range(0, n, BLOCK)) + [n]
    maxes = [max(positions[a:b]) + 1 for a, b in zip(edges, edges[1:])]
    k = len(maxes)
    best = [0.0] + [float("inf")] * k  # best[j]: cost of blocks [0, j)
    cut = [0] * (k + 1)
    for j in range(1, k + 1):
        s = 0
        for i in range(j - 1, -1, -1):  # last chunk = blocks [i, j)
            s = max(s, maxes[i])
            c = best[i] + (edges[j] - edges[i]) * s + CHUNK_COST
            if c < best[j]:
                best[j], cut[j] = c, i
    out = []
    j = k
    while j:
        i = cut[j]
        out.append((edges[i], edges[j], max(maxes[i:j]), min(positions[edges[i] : edges[j]])))
        j = i
    return out[::-1]


def work(chunks: list[Chunk]) -> int:
    return sum((hi - lo) * S for lo, hi, S, *_ in chunks)


def overhead(positions: list[int], chunks: list[Chunk]) -> float:
    """Chunked attention work over the ideal (every row reading exactly its own length)."""
    return work(chunks) / (sum(positions) + len(positions))


def needs_sort(ratio: float, sorted_ratio: float, steps_since_sort: int) -> bool:
    """`ratio`: overhead now; `sorted_ratio`: right after the last sort (what sorting can reach)."""
    return steps_since_sort >= SORT_EVERY and ratio > SORT_SLACK * sorted_ratio
