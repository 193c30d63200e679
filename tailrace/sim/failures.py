"""Worker failures in a simulated run: when workers die, how long they take to come back, and what
the run loses, so `tailrace sim` reports an effective training time ratio at cluster scale.

The model follows what the runtime does (RobustRL's scheme): a failed engine is detected after
`detect_s` (the heartbeat timeout), replaced after `restart_s` more and reloads the versions it held;
its in-flight samples go back to their groups (`Scheduler.on_engine_lost`) and are generated again;
nothing already finished is lost. A failed trainer restarts the same way from its last checkpoint
(taken at every publishing step) and redoes the steps since, then the step it was in; the scheduler
never sees it: its steps only take longer. Failures arrive as a Poisson process per worker (mean
time between failures `*_mtbf_s`; 0 = that worker never fails), drawn from `seed`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tailrace.common import ConfigError
from tailrace.config.fields import setting


@dataclass
class FailureSpec:
    engine_mtbf_s: float = setting(0.0, "mean seconds between failures of each engine (0 = never)")
    trainer_mtbf_s: float = setting(0.0, "mean seconds between failures of the trainer (0 = never)")
    detect_s: float = setting(10.0, "seconds until a failure is noticed (the heartbeat timeout)")
    restart_s: float = setting(60.0, "seconds to start a replacement process and load the model")
    seed: int = setting(0, "seed of the failure times")

    def __post_init__(self) -> None:
        for k in ("engine_mtbf_s", "trainer_mtbf_s", "detect_s", "restart_s"):
            if getattr(self, k) < 0:
                raise ConfigError(f"failures.{k}={getattr(self, k)}: must be >= 0 seconds")

    @property
    def active(self) -> bool:
        return self.engine_mtbf_s > 0 or self.trainer_mtbf_s > 0

    def arrivals(self, worker: int, mtbf_s: float) -> FailureClock:
        return FailureClock(random.Random(self.seed * 1_000_003 + worker), mtbf_s)


@dataclass
class FailureClock:
    """The failure times of one worker, in order (exponential gaps of mean `mtbf_s`)."""

    rng: random.Random
    mtbf_s: float
    t: float = 0.0

    def next(self) -> float:
        """The next failure time (inf when the worker never fails)."""
        if self.mtbf_s <= 0:
            return float("inf")
        self.t += self.rng.expovariate(1.0 / self.mtbf_s)
        return self.t


@dataclass
class FailureLog:
    """What failures cost a simulated run (the summary's `failures`)."""

    engine: int = 0  # engine failures
    trainer: int = 0  # trainer failures
    requeued: int = 0  # in-flight samples generated again
    engine_down_s: float = 0.0  # engine-seconds without a serving engine
    trainer_down_s: float = 0.0  # trainer seconds spent detecting and restarting
    trainer_redo_s: float = 0.0  # trainer compute lost and done again (steps since the checkpoint)
    events: list[tuple[float, str, int]] = field(default_factory=list)  # (time, worker kind, worker id)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "events"}
        return d | {"count": len(self.events)}
