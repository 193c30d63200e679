"""Prefill planning: which prompt tokens to run this step (pure Python).

A step prefills at most `budget` tokens, first come first served, so a long prompt is cut into
pieces and never stalls the decode batch for more than one budget's worth of compute. The pieces run
in the same forward as the decode rows (see `Backend.forward`), so no padding is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tailrace.engine.sequence import Sequence


@dataclass(frozen=True)
class Piece:
    seq: Sequence
    start: int  # first position (index into seq.ids)
    n: int  # tokens

    @property
    def completes(self) -> bool:
        return self.start + self.n == len(self.seq.ids)


def plan(prefilling: Iterable[Sequence], budget: int) -> list[Piece]:
    pieces = []
    for seq in prefilling:
        if budget <= 0:
            break
        n = min(seq.to_prefill, budget)
        pieces.append(Piece(seq, seq.prefilled, n))
        budget -= n
    return pieces
