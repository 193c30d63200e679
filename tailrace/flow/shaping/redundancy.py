"""DARTS' adaptive redundancy: how many candidates each prompt of a window gets, from what its
earlier samples said about its length spread.

`LengthStats` keeps, per prompt id, an exponential moving average of the mean and variance of its
samples' lengths (updated once per completed group); a prompt not seen yet uses the task-level prior,
the moving average of every observed group's variance. `allocate` spends an extra-sample budget
greedily on the prompts of largest variance, each getting between M and 2M candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class LengthStats:
    alpha: float = 0.5  # weight of the newest group in each moving average
    mean: dict[int, float] = field(default_factory=dict)  # prompt id -> EMA of its mean length
    var: dict[int, float] = field(default_factory=dict)  # prompt id -> EMA of its length variance
    prior: float | None = None  # EMA of every observed group's variance (cold prompts' estimate)

    def observe(self, prompt_id: int, lengths: Sequence[int]) -> None:
        """One completed group's sample lengths (population mean and variance)."""
        if not lengths:
            return
        mu = sum(lengths) / len(lengths)
        var = sum((x - mu) ** 2 for x in lengths) / len(lengths)
        a = self.alpha
        self.mean[prompt_id] = mu if prompt_id not in self.mean else (1 - a) * self.mean[prompt_id] + a * mu
        self.var[prompt_id] = var if prompt_id not in self.var else (1 - a) * self.var[prompt_id] + a * var
        self.prior = var if self.prior is None else (1 - a) * self.prior + a * var

    def variance(self, prompt_id: int) -> float:
        """The prompt's estimated length variance (the prior for a cold prompt; 0 before any data)."""
        return self.var.get(prompt_id, self.prior or 0.0)

    def state_dict(self) -> dict:
        return {
            "mean": [[k, v] for k, v in self.mean.items()],
            "var": [[k, v] for k, v in self.var.items()],
            "prior": self.prior,
        }

    def load_state_dict(self, d: dict) -> None:
        self.mean = {int(k): v for k, v in d["mean"]}
        self.var = {int(k): v for k, v in d["var"]}
        self.prior = d["prior"]


def allocate(variances: Sequence[float], m: int, budget: int) -> list[int]:
    """Candidates per prompt: m each, then up to m more each to the prompts of largest variance first
    until `budget` extra samples are spent (ties: the earlier prompt first). Each result lies in
    [m, 2m] and they sum to at most m * len(variances) + budget."""
    if budget < 0:
        raise ValueError(f"redundancy budget {budget} is negative")
    counts = [m] * len(variances)
    for i in sorted(range(len(variances)), key=lambda i: (-variances[i], i)):
        extra = min(m, budget)
        counts[i] += extra
        budget -= extra
        if budget == 0:
            break
    return counts
