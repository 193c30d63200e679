"""`Runs`: an immutable sequence stored as (value, count) runs — the simulator's token ids, logprobs
and per-token versions, which are long and nearly constant (one value per segment).

It is an exact `Sequence`: len, indexing, iteration, equality with tuples and concatenation mean what
they mean for the expanded tuple; only memory is O(runs) instead of O(tokens), so a 30K-token
trajectory costs a few dozen bytes. Iteration expands in C (itertools), so code that scans every
token (the core's one-version check) still pays O(tokens), but nothing else does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any


class Runs(Sequence):
    __slots__ = ("runs", "_len")

    def __init__(self, runs: tuple[tuple[Any, int], ...] = ()) -> None:
        merged: list[tuple[Any, int]] = []
        for v, n in runs:
            if n <= 0:
                continue
            if merged and merged[-1][0] == v:
                merged[-1] = (v, merged[-1][1] + n)
            else:
                merged.append((v, n))
        self.runs = tuple(merged)
        self._len = sum(n for _, n in merged)

    @classmethod
    def of(cls, value: Any, n: int) -> "Runs":
        r = object.__new__(cls)
        r.runs, r._len = (((value, n),) if n > 0 else ()), max(n, 0)
        return r

    @classmethod
    def from_seq(cls, seq) -> "Runs":
        if isinstance(seq, Runs):
            return seq
        return cls(tuple((v, len(list(g))) for v, g in itertools.groupby(seq)))

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        if len(self.runs) == 1:  # the common case: one C iterator, no chaining
            return itertools.repeat(*self.runs[0])
        return itertools.chain.from_iterable(itertools.repeat(v, n) for v, n in self.runs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("Runs index out of range")
        for v, n in self.runs:
            if i < n:
                return v
            i -= n
        raise IndexError("Runs index out of range")  # pragma: no cover

    def __add__(self, other) -> "Runs":
        if not isinstance(other, (Runs, tuple, list)):
            return NotImplemented
        if not self._len:
            return Runs.from_seq(other)
        if not other:
            return self
        return Runs(self.runs + Runs.from_seq(other).runs)

    def __radd__(self, other) -> "Runs":
        if not isinstance(other, (tuple, list)):
            return NotImplemented
        return Runs(Runs.from_seq(other).runs + self.runs)

    def __eq__(self, other) -> bool:
        if isinstance(other, Runs):
            return self.runs == other.runs
        if isinstance(other, (tuple, list)):
            return self._len == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))  # equal to the hash of the equal tuple

    def __deepcopy__(self, memo) -> "Runs":
        return self  # immutable

    def __repr__(self) -> str:
        return f"Runs({list(self.runs)})"

    def values(self) -> set:
        """The distinct values, in O(runs)."""
        return {v for v, _ in self.runs}

    def min(self):
        return min(v for v, _ in self.runs)

    def map(self, f) -> "Runs":
        """`f` applied to every value, run by run (what `flow.multi` calls to translate versions)."""
        return Runs(tuple((f(v), n) for v, n in self.runs))
