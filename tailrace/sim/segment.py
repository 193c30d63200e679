"""`Segment`: a run of decode steps over a constant batch, summed in closed form.

While no request joins or leaves an engine's batch, every running sequence gains one token per
step, so the context each version's forward reads grows linearly with the step index k. Both sides
of the roofline are then linear in k, and one step costs

    T(k) = base + sum_i max(a_i + b_i k, c_i + d_i k)        (one term per version in the batch)

Each max switches side at most once, so sum_{k<n} T(k) is a sum of arithmetic series: the time to
the next completion costs O(versions), however many tokens lie between. This is what lets the
simulator take one event per request boundary instead of one per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _series(a: float, b: float, k0: int, k1: int) -> float:
    """sum_{k=k0}^{k1-1} (a + b k)."""
    n = k1 - k0
    if n <= 0:
        return 0.0
    return n * a + b * (k0 + k1 - 1) * n / 2.0


def _sum_max(a: float, b: float, c: float, d: float, n: int) -> float:
    """sum_{k<n} max(a + b k, c + d k)."""
    if b == d:
        return _series(a, b, 0, n) if a >= c else _series(c, d, 0, n)
    cross = (c - a) / (b - d)  # f - g changes sign here
    m = n if cross >= n else 0 if cross <= 0 else math.ceil(cross)
    if b > d:  # f >= g from the crossing on
        return _series(c, d, 0, m) + _series(a, b, m, n)
    return _series(a, b, 0, m) + _series(c, d, m, n)


@dataclass(frozen=True)
class Segment:
    base: float  # seconds per step that do not depend on the context (overheads)
    terms: tuple[tuple[float, float, float, float], ...]  # (a, b, c, d): memory a+bk vs compute c+dk
    gap: float = 0.0  # host time after each step that is not busy time (Hardware.host_gap_s)

    def step_time(self, k: int) -> float:
        """Duration of step k (0-based) of the segment, its gap included."""
        return self.base + self.gap + sum(max(a + b * k, c + d * k) for a, b, c, d in self.terms)

    def scaled(self, f: float) -> "Segment":
        """Every step f times as long (exact: max(f a, f c) = f max(a, c) for f > 0)."""
        return Segment(
            self.base * f, tuple((a * f, b * f, c * f, d * f) for a, b, c, d in self.terms), self.gap * f
        )

    def time(self, n: int) -> float:
        """Duration of the first n steps, their gaps included."""
        if n <= 0:
            return 0.0
        return n * (self.base + self.gap) + sum(_sum_max(a, b, c, d, n) for a, b, c, d in self.terms)

    def busy(self, n: int) -> float:
        """The part of time(n) that is steps (busy time): without the gaps."""
        return self.time(n) - n * self.gap if n > 0 else 0.0

    def steps_within(self, dt: float) -> int:
        """The most whole steps that fit in dt seconds."""
        if dt <= 0 or self.time(1) > dt:
            return 0
        hi = 1
        while self.time(hi) <= dt:
            hi *= 2
        lo = hi // 2  # time(lo) <= dt < time(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.time(mid) <= dt:
                lo = mid
            else:
                hi = mid
        return lo
