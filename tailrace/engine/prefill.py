"""Prefill planning: which prompt tokens to run this step, and how to batch them (pure Python).

A step prefills at most `budget` tokens, first come first served, so a long prompt is cut into
chunks and never stalls the decode batch for more than one budget's worth of compute. Chunks of one
version run as right-padded batches; a chunk joins a batch only while padding stays under
`PAD_SLACK` of the batch's real tokens, so one long chunk and many short ones do not multiply work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence as Seq

from tailrace.engine.sequence import Sequence

PAD_SLACK = 0.25


@dataclass(frozen=True)
class Chunk:
    seq: Sequence
    start: int  # first position (index into seq.ids)
    n: int  # tokens

    @property
    def completes(self) -> bool:
        return self.start + self.n == len(self.seq.ids)


def plan(prefilling: Iterable[Sequence], budget: int) -> list[Chunk]:
    chunks = []
    for seq in prefilling:
        if budget <= 0:
            break
        n = min(seq.to_prefill, budget)
        chunks.append(Chunk(seq, seq.prefilled, n))
        budget -= n
    return chunks


def batches(chunks: Seq[Chunk], max_len: int) -> list[list[Chunk]]:
    """Group chunks of the same version into padded batches (longest first). Pad positions run past a
    chunk's end, so a chunk whose padded end would pass `max_len` only batches with shorter ones."""
    out: list[list[Chunk]] = []
    by_version: dict[int, list[Chunk]] = {}
    for c in chunks:
        by_version.setdefault(c.seq.version, []).append(c)
    for group in by_version.values():
        group.sort(key=lambda c: -c.n)
        cur: list[Chunk] = []
        real = 0
        for c in group:
            T = cur[0].n if cur else c.n
            fits = all(x.start + T <= max_len for x in (*cur, c))
            if cur and fits and (len(cur) + 1) * T <= (1 + PAD_SLACK) * (real + c.n):
                cur.append(c)
                real += c.n
            else:
                if cur:
                    out.append(cur)
                cur, real = [c], c.n
        if cur:
            out.append(cur)
    return out
