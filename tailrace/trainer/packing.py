"""How the trainer splits a batch into micro-batches, torch-free so the simulator charges exactly the
padding tailrace's trainer computes (`trainer.batch.TrainBatch.micro_batches`, `sim.costs.CostModel`)."""

from __future__ import annotations


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch: rows taken longest first, a micro-batch holding rows x its longest
    row <= max_tokens (a longer single row goes alone), so each pads little."""
    out: list[list[int]] = []
    cur: list[int] = []
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if cur and lengths[cur[0]] * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(b)
    if cur:
        out.append(cur)
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
