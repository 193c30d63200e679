"""The learning rate at each optimizer step: a linear warmup, then constant, linear or cosine decay.

Pure and stateless: the rate is a function of the optimizer steps already taken, so a resumed trainer
(its step count restored from the checkpoint) and a replayed step take the rate the first run took.
The warm start's SFT and the RL trainer share it (`train.lr_warmup_steps`, `train.lr_schedule`,
`train.lr_min_ratio`; the warm start: cosine down to a tenth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tailrace.config.train import DECAYS


@dataclass(frozen=True)
class LRSchedule:
    lr: float  # the peak
    warmup: int = 0  # steps of linear warmup: lr x 1/warmup, 2/warmup, ..., lr
    total: int = 0  # the decay's last step (the run's steps); unused by constant
    decay: str = "constant"  # after the warmup
    floor: float = 0.0  # the decay ends at lr x floor

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"decay {self.decay!r}: one of {', '.join(DECAYS)}")
        if self.decay != "constant" and self.total <= 0:
            raise ValueError(f"a {self.decay} decay needs the run's steps (total={self.total})")

    def lr_at(self, step: int) -> float:
        """The rate of the optimizer step after `step` steps were taken (0: the first)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.decay == "constant":
            return self.lr
        frac = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        shape = 1.0 - frac if self.decay == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
        return self.lr * (self.floor + (1 - self.floor) * shape)

    def describe(self) -> str:
        """e.g. 'warmup 10 steps, then cosine decay to 0.1 x the peak at step 120' ('' when constant
        without warmup)."""
        parts = [f"warmup {self.warmup} step{'s' if self.warmup > 1 else ''}"] if self.warmup else []
        if self.decay != "constant":
            to = f"{self.floor:g} x the peak" if self.floor else "0"
            parts.append(f"{self.decay} decay to {to} at step {self.total}")
        return ", then ".join(parts)
