"""Metric definitions (DESIGN.md §5), computed once here and used by runs, benches and the simulator.

Deterministic quantities (rewards, lengths, staleness, losses) sit at the top level of a step record;
everything that depends on wall-clock time sits under "time", so two runs of the same seed can be
compared exactly on the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tailrace.metrics import length_stats, percentile, staleness_hist

__all__ = ["Utilization", "length_stats", "percentile", "staleness_hist"]


@dataclass
class Utilization:
    """Busy time of the trainer and slot-time of the engines, cumulative since the run started.

    trainer waiting ratio = trainer idle (waiting for data) / wall time;
    rollout bubble ratio = engine slot-time idle / engine slot-time available;
    mean active batch = engine slot-time / engine busy time (sequences per decode step while generating).
    """

    start: float
    slots: int  # total slots over all engines
    trainer_busy: float = 0.0
    slot_time: float = 0.0
    gen_tokens: int = 0
    train_tokens: int = 0
    engine_busy: float = 0.0
    sync_time: float = 0.0
    history: list[tuple[float, float, float, int, int]] = field(default_factory=list)

    def snapshot(self, now: float) -> dict:
        """Cumulative ratios, and the same over the window since the previous snapshot."""
        wall = max(1e-9, now - self.start)
        cur = (now, self.trainer_busy, self.slot_time, self.gen_tokens, self.train_tokens)
        prev = self.history[-1] if self.history else (self.start, 0.0, 0.0, 0, 0)
        self.history.append(cur)
        dt = max(1e-9, now - prev[0])
        return {
            "wall_s": wall,
            "trainer_wait_ratio": 1.0 - min(1.0, self.trainer_busy / wall),
            "bubble_ratio": 1.0 - min(1.0, self.slot_time / (self.slots * wall)),
            "mean_active_batch": self.slot_time / self.engine_busy if self.engine_busy > 0 else 0.0,
            "step_s": dt,
            "step_trainer_wait_ratio": 1.0 - min(1.0, (self.trainer_busy - prev[1]) / dt),
            "step_bubble_ratio": 1.0 - min(1.0, (self.slot_time - prev[2]) / (self.slots * dt)),
            "gen_tok_s": (self.gen_tokens - prev[3]) / dt,
            "train_tok_s": (self.train_tokens - prev[4]) / dt,
        }
