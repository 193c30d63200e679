"""One contiguous buffer for all of a model's parameters.

Every parameter is moved into one 1-D buffer and becomes a view of it, so a weight export is one
memcpy out of the buffer and an import one memcpy in (the Megatron contiguous-buffer idea); the
trainer's AdamW updates the views in place, and engines rebuild named views over a received buffer
from the layout alone. Tied weights (one Parameter under two names) occupy one slice; the layout
lists both names at the same offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

Layout = tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, offset) per parameter name


@dataclass(frozen=True)
class FlatWeights:
    """One policy's weights: a contiguous 1-D buffer and the layout that names its slices."""

    buffer: torch.Tensor  # (numel,), contiguous
    layout: Layout

    def views(self) -> dict[str, torch.Tensor]:
        """name -> view into `buffer` (no copy); tied names share storage."""
        return {n: self.buffer[o : o + math.prod(s)].view(s) for n, s, o in self.layout}


def flatten_parameters(model: nn.Module, trainable: bool = False) -> FlatWeights:
    """Move `model`'s parameters into one buffer and make each a view of it; returns the live buffer.
    `trainable`: only those that require a gradient (a LoRA adapter on a frozen base: what a trainer
    publishes is the adapter), the others left where they are.

    All parameters must share one dtype and device (e.g. fp32 master weights). Call before building
    the optimizer; afterwards do not replace parameters (`.to()` on the model would detach them).
    """
    # parameters() yields a tied weight once
    uniq = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad or not trainable]
    if not uniq:
        raise ValueError("model has no parameters to train")
    kinds = {(p.dtype, p.device) for p in uniq}
    if len(kinds) != 1:
        raise ValueError(
            f"parameters mix dtypes/devices {sorted(map(str, kinds))}; keep one master copy "
            f"(e.g. fp32 weights with bf16 autocast)"
        )
    dtype, device = kinds.pop()
    offsets, total = {}, 0
    for p in uniq:
        offsets[id(p)] = total
        total += p.numel()
    buf = torch.empty(total, dtype=dtype, device=device)
    with torch.no_grad():
        for p in uniq:
            o = offsets[id(p)]
            buf[o : o + p.numel()].copy_(p.reshape(-1))
            p.grad = None
            p.data = buf[o : o + p.numel()].view_as(p)
    layout = tuple(
        (n, tuple(p.shape), offsets[id(p)])
        for n, p in model.named_parameters(remove_duplicate=False)
        if id(p) in offsets
    )
    return FlatWeights(buf, layout)
