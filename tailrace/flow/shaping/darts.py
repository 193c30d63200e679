"""darts: dual-end sampling with adaptive redundancy (DARTS, TECHNIQUES.md §5).

Prompts are planned in windows of `window` (the round size R): an extra budget of `extra` x M x R
samples (or, with `extra` None, what the engines' measured step cost affords for `extra_time` more of
a round's time: redundancy.cost_budget) goes greedily to the prompts of largest estimated length
variance, each getting M'_i in [M, 2M] candidates (redundancy.py). A group waits for all its
candidates, then trains on the K shortest non-truncated plus the L longest (select.py; K + L = M);
the rest are discards with the reason `shaping`, and the reward of what is kept is never changed.
The `early_stop` fraction of a window's prompts with the largest variance (among those at 2M) stop at
their first M non-truncated finishers, and the core aborts the rest: the most expensive tails are
never waited for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from tailrace.flow.shaping.base import Plan, Shaping
from tailrace.flow.shaping.redundancy import LengthStats, StepCost, allocate, cost_budget
from tailrace.flow.shaping.select import dual_end
from tailrace.types import Prompt, Trajectory

if TYPE_CHECKING:
    from tailrace.flow.store import GroupState


_OPTIONS = ("window", "extra", "longest", "early_stop", "ema", "extra_time")


class Darts(Shaping):
    name = "darts"

    def __init__(
        self,
        window: int = 1,
        extra: float | None = 0.5,
        longest: int = 1,
        early_stop: float = 0.1,
        ema: float = 0.5,
        extra_time: float = 0.1,
    ) -> None:
        if extra is not None and not 0 <= extra <= 1:
            raise ValueError(
                f"shaping.extra={extra}: must lie in [0, 1] (a fraction of M x R extra samples), or null "
                "for the budget the engines' step cost affords"
            )
        if not 0 <= early_stop <= 1:
            raise ValueError(f"shaping.early_stop={early_stop}: must lie in [0, 1] (a fraction of R)")
        if longest < 0:
            raise ValueError(f"shaping.longest={longest}: must be >= 0")
        if not 0 < ema <= 1:
            raise ValueError(f"shaping.ema={ema}: must lie in (0, 1]")
        if extra_time < 0:
            raise ValueError(f"shaping.extra_time={extra_time}: must be >= 0 (a share of a round's time)")
        self.window, self.extra, self.longest, self.early_stop = window, extra, longest, early_stop
        self.extra_time = extra_time
        self.stats = LengthStats(alpha=ema)
        self.cost = StepCost()
        self.slots = 0  # the engines' rows in all, as last reported

    @classmethod
    def from_options(cls, **options) -> Darts:
        """The run's shaping options this one reads (the defaults are __init__'s)."""
        return cls(**{k: v for k, v in options.items() if k in _OPTIONS})

    def budget(self, n: int) -> int:
        """Extra candidates for a window of n samples: the fixed share, or what the step cost affords
        (none before the engines' reports and a completed group say what a step and a response cost)."""
        if self.extra is not None:
            return round(self.extra * n)
        fit, s = self.cost.fit(), self.stats
        if fit is None or not s.typical or not self.slots:
            return 0
        return cost_budget(n, self.slots, *fit, s.typical, max(s.longest, s.typical), self.extra_time)

    def plan(self, prompts: Sequence[Prompt], m: int) -> list[Plan]:
        if self.longest > m:
            raise ValueError(f"shaping.longest={self.longest}: must be <= flow.samples_per_prompt={m}")
        var = [self.stats.variance(p.id) for p in prompts]
        counts = allocate(var, m, self.budget(m * len(prompts)))
        full = sorted((i for i, n in enumerate(counts) if n == 2 * m), key=lambda i: (-var[i], i))
        early = set(full[: round(self.early_stop * len(prompts))])
        return [Plan(n, i in early) for i, n in enumerate(counts)]

    def enough(self, g: GroupState) -> bool:
        return g.early_stop and sum(not t.truncated for t in g.done) >= g.size

    def select(self, g: GroupState) -> tuple[list[Trajectory], list[Trajectory]]:
        return dual_end(g.done, g.size, self.longest)

    def observe(self, g: GroupState) -> None:
        self.stats.observe(g.prompt.id, [t.length for t in g.done])

    def observe_steps(
        self, steps: int, decode_tokens: int, prefill_tokens: int, busy_s: float, slots: int
    ) -> None:
        self.cost.add(steps, decode_tokens, prefill_tokens, busy_s)
        self.slots = slots

    def state_dict(self) -> dict:
        return {"stats": self.stats.state_dict(), "cost": self.cost.state_dict(), "slots": self.slots}

    def load_state_dict(self, d: dict) -> None:
        self.stats.load_state_dict(d["stats"])
        if "cost" in d:  # older checkpoints: no step cost yet
            self.cost.load_state_dict(d["cost"])
            self.slots = d["slots"]
