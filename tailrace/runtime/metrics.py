"""Metric definitions (DESIGN.md §5), computed once here and used by runs, benches and the simulator.

Deterministic quantities (rewards, lengths, staleness, losses) sit at the top level of a step record;
everything that depends on wall-clock time sits under "time", so two runs of the same seed can be
compared exactly on the rest.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from tailrace.types import Finish, Trajectory


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def length_stats(trajs: list[Trajectory]) -> dict:
    """Tail of the response-length distribution of one step's trajectories."""
    lens = [t.length for t in trajs]
    if not lens:
        return {}
    by_prompt = defaultdict(list)
    for t in trajs:
        by_prompt[t.group].append(t.length)
    stds = [_std(v) for v in by_prompt.values() if len(v) > 1]
    p50, mx = percentile(lens, 50), max(lens)
    mean = sum(lens) / len(lens)
    return {"p50": p50, "p90": percentile(lens, 90), "p99": percentile(lens, 99), "max": mx, "mean": mean,
            "max_over_median": mx / p50 if p50 else float("nan"),
            "intra_prompt_std": sum(stds) / len(stds) if stds else 0.0,
            "truncated_frac": sum(t.result.finish == Finish.LENGTH for t in trajs) / len(trajs),
            "bubble": (mx - mean) / mx if mx else 0.0}


def _std(v: list[float]) -> float:
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / len(v))


@dataclass
class Utilization:
    """Busy time of the trainer and slot-time of the engines, cumulative since the run started.

    trainer waiting ratio = trainer idle (waiting for data) / wall time;
    rollout bubble ratio = engine slot-time idle / engine slot-time available.
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
            "step_s": dt,
            "step_trainer_wait_ratio": 1.0 - min(1.0, (self.trainer_busy - prev[1]) / dt),
            "step_bubble_ratio": 1.0 - min(1.0, (self.slot_time - prev[2]) / (self.slots * dt)),
            "gen_tok_s": (self.gen_tokens - prev[3]) / dt,
            "train_tok_s": (self.train_tokens - prev[4]) / dt,
        }


def staleness_hist(trajs: list[Trajectory], trainer_version: int) -> dict[str, int]:
    c = Counter(trainer_version - t.oldest_version for t in trajs)
    return {str(k): v for k, v in sorted(c.items())}
