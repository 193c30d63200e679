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
