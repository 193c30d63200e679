"""Advantage estimators: a step's groups' rewards in, one advantage per trajectory out.

Pure functions on plain floats (no torch), picked once by name from `ADVANTAGES`. Most look at one group
at a time (`by_group`); `batch_std` scales by the whole step's rewards. Every trajectory gets a scalar;
the batch broadcasts it over that trajectory's response tokens.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

Advantage = Callable[[Sequence[float]], list[float]]  # one group's rewards -> its advantages
StepAdvantage = Callable[[Sequence[Sequence[float]]], list[list[float]]]  # a step's groups' -> theirs

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


def batch_std(groups: Sequence[Sequence[float]]) -> list[list[float]]:
    """(r - its group's mean) / (std of all the step's rewards + 1e-6), population std as grpo's: the
    group's baseline at the batch's scale (Lite PPO, "Tricks or Traps? A Deep Dive into RL for LLM
    Reasoning", 2025; TRL's scale_rewards="batch"). A group whose rewards barely differ keeps small
    advantages, where grpo's per-group std blows them up to about +-1."""
    flat = [x for r in groups for x in r]
    if not flat:
        return [[] for _ in groups]
    m = _mean(flat)
    std = math.sqrt(sum((x - m) ** 2 for x in flat) / len(flat))
    return [[(x - _mean(r)) / (std + STD_EPS) for x in r] for r in groups]


def by_group(f: Advantage) -> StepAdvantage:
    """A step's estimator that gives each group `f` of its own rewards."""

    def step(groups: Sequence[Sequence[float]]) -> list[list[float]]:
        return [f(r) for r in groups]

    step.__doc__ = f.__doc__
    return step


def outcome(groups: Sequence[Sequence[float]]) -> list[list[float]]:
    """The rewards as they are: PPO's critic (`train.advantage=gae`, trainer/critic.py) turns each into
    per-token advantages against its values; a batch built without the critic trains on raw rewards."""
    return [list(r) for r in groups]


ADVANTAGES: dict[str, StepAdvantage] = {
    "grpo": by_group(grpo),
    "drgrpo": by_group(drgrpo),
    "rloo": by_group(rloo),
    "batch_std": batch_std,
    "gae": outcome,
}
