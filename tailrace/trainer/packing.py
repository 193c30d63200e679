"""How the trainer splits a batch into micro-batches, torch-free so the simulator charges exactly the
padding tailrace's trainer computes (`trainer.batch.TrainBatch.micro_batches`, `sim.costs.CostModel`)."""

from __future__ import annotations

MICRO_BATCH_COST = 1 / 32  # what one more micro-batch costs, in padded tokens per token of the cap


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch, padding as little as one more micro-batch is worth.

    A micro-batch is padded to its longest row, so it computes rows x longest tokens (at most
    max_tokens; a longer single row goes alone). Rows sorted longest first are cut into consecutive
    runs minimizing padded tokens + MICRO_BATCH_COST x max_tokens per micro-batch (its fixed cost: the
    per-layer calls of a forward and backward), by dynamic programming from the shortest row: long-tailed
    lengths put the few long rows together and the many short ones apart, instead of padding short
    rows to a long one (greedy filling to the cap padded a long-tailed RL batch to ~1.6x its tokens;
    this ~1.1x). Ties keep fewer, fuller micro-batches."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    L = [max(1, lengths[i]) for i in order]
    n, fixed = len(L), MICRO_BATCH_COST * max_tokens
    best, cut = (
        [0.0] * (n + 1),
        [n] * (n + 1),
    )  # best[i]: the cost of rows i.. ; they start at i, end at cut[i]
    for i in range(n - 1, -1, -1):
        best[i] = float("inf")
        for j in range(min(n, i + max(1, max_tokens // L[i])), i, -1):  # longest run first: ties keep it
            c = (j - i) * L[i] + fixed + best[j]
            if c < best[i]:
                best[i], cut[i] = c, j
    out, i = [], 0
    while i < n:
        out.append(order[i : cut[i]])
        i = cut[i]
    return out


def split_by_tokens(lengths: list[int], world: int) -> list[list[int]]:
    """Row indices per data-parallel rank, balanced by tokens, not rows: rows longest first, each to
    the rank with the fewest tokens so far (ties: the lower rank), so a few long responses do not
    leave the other ranks idle. Each rank's rows in index order."""
    if world < 1:
        raise ValueError(f"world={world}: must be at least 1")
    load, out = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += lengths[i]
    return [sorted(rows) for rows in out]
