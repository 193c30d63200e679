"""Metric definitions (DESIGN.md §5), computed once here and used by runs, benches and the simulator.

Deterministic quantities (rewards, lengths, staleness, losses) sit at the top level of a step record;
everything that depends on wall-clock time sits under "time", so two runs of the same seed can be
compared exactly on the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tailrace.metrics import length_stats, percentile, speculation, staleness_hist, utilization

__all__ = ["SpecTally", "Utilization", "length_stats", "percentile", "staleness_hist"]


@dataclass
class Utilization:
    """Busy time of the trainer and slot-time of the engines, cumulative since the run started.

    The ratios are `tailrace.metrics.utilization`'s.
    """

    start: float
    slots: int  # total slots over all engines
    trainer_busy: float = 0.0
    slot_time: float = 0.0
    gen_tokens: int = 0
    train_tokens: int = 0
    engine_busy: float = 0.0
    history: list[tuple[float, float, float, int, int]] = field(default_factory=list)

    @classmethod
    def resumed(cls, now: float, slots: int, last: dict | None) -> Utilization:
        """A resumed run's, from `last`, the time figures of its last step record kept (None: none,
        a fresh start): its clock goes on from that step's wall_s (the time it was down not counted),
        its cumulative ratios from the busy times they imply, and the first step's window starts now."""
        if not last:
            return cls(now, slots)
        wall = last["wall_s"]
        busy = (1.0 - last["trainer_wait_ratio"]) * wall
        slot_time = (1.0 - last["bubble_ratio"]) * slots * wall
        batch = last.get("mean_active_batch", 0.0)
        engine_busy = slot_time / batch if batch > 0 else 0.0
        u = cls(now - wall, slots, trainer_busy=busy, slot_time=slot_time, engine_busy=engine_busy)
        u.history.append((now, busy, slot_time, 0, 0))
        return u

    def snapshot(self, now: float) -> dict:
        """Cumulative ratios, and the same over the window since the previous snapshot."""
        cur = (now, self.trainer_busy, self.slot_time, self.gen_tokens, self.train_tokens)
        prev = self.history[-1] if self.history else (self.start, 0.0, 0.0, 0, 0)
        self.history.append(cur)
        return utilization(self.start, cur, prev, self.slots, self.engine_busy)


@dataclass
class SpecTally:
    """The engines' speculative-decoding counts since the last step record (see `metrics.speculation`)."""

    counts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # rows, verifies, drafted, accepted
    by_version: dict[int, list[int]] = field(default_factory=dict)  # version -> [drafted, accepted]
    train: tuple[int, float] = (0, 0.0)  # a trained drafter's steps and seconds

    def add(self, counts: list[int], by_version: dict[int, list[int]], train: tuple[int, float]) -> None:
        self.counts = [a + b for a, b in zip(self.counts, counts)]
        for v, (d, a) in by_version.items():
            c = self.by_version.setdefault(v, [0, 0])
            c[0] += d
            c[1] += a
        self.train = (self.train[0] + train[0], self.train[1] + train[1])

    def take(self, own: Callable[[int], int | None] | None = None) -> dict:
        """The figures of the window, which starts anew. `own` (a run of several policies): the record's
        policy's version of an engine version, None for another policy's, whose counts by version stay
        for that policy's record."""
        mine, rest = self.by_version, {}
        if own is not None:
            mine = {}
            for v, c in self.by_version.items():
                mapped = own(v)
                if mapped is None:
                    rest[v] = c
                else:
                    mine[mapped] = c
        out = speculation(*self.counts, by_version=mine, train=self.train)
        self.counts, self.by_version, self.train = [0, 0, 0, 0], rest, (0, 0.0)
        return out
