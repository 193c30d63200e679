"""Group advantage estimators: one group's rewards in, one advantage per trajectory out.

Pure functions on plain floats (no torch), picked once by name from `ADVANTAGES`. Every trajectory
of a group gets a scalar; the batch broadcasts it over that trajectory's response tokens.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

Advantage = Callable[[Sequence[float]], list[float]]

STD_EPS = 1e-6  # keeps a group whose rewards barely differ from blowing up


def _mean(r: Sequence[float]) -> float:
    return sum(r) / len(r)


def grpo(rewards: Sequence[float]) -> list[float]:
    """(r - mean) / (std + 1e-6), population std (GRPO, DeepSeekMath)."""
    m = _mean(rewards)
    std = math.sqrt(sum((x - m) ** 2 for x in rewards) / len(rewards))
    return [(x - m) / (std + STD_EPS) for x in rewards]


def drgrpo(rewards: Sequence[float]) -> list[float]:
    """r - mean: Dr. GRPO drops the std division, which up-weights near-solved and near-failed groups."""
    m = _mean(rewards)
    return [x - m for x in rewards]


def rloo(rewards: Sequence[float]) -> list[float]:
    """r_i - mean_{j != i} r_j (REINFORCE leave-one-out); a group of one has no baseline, so 0."""
    n = len(rewards)
    if n == 1:
        return [0.0]
    s = sum(rewards)
    return [x - (s - x) / (n - 1) for x in rewards]


ADVANTAGES: dict[str, Advantage] = {"grpo": grpo, "drgrpo": drgrpo, "rloo": rloo}
