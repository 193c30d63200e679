"""darts: dual-end sampling with adaptive redundancy (DARTS, TECHNIQUES.md §5).

Prompts are planned in windows of `window` (the round size R): an extra budget of `extra` x M x R
samples (or, with `extra` None, the budget of least predicted round time under the engines' and the
trainer's measured costs: benefit.best_budget) goes greedily to the prompts of largest estimated
length variance, each getting M'_i in [M, 2M] candidates (redundancy.py). A group waits for all its
candidates, then trains on the K shortest non-truncated plus the L longest (select.py; K + L = M);
the rest are discards with the reason `shaping`, and the reward of what is kept is never changed.
The `early_stop` fraction of a window's prompts with the largest variance (among those at 2M) stop at
their first M non-truncated finishers, and the core aborts the rest: the most expensive tails are
never waited for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from tailrace.flow.shaping.base import Plan, Shaping
from tailrace.flow.shaping.benefit import Costs, best_budget
from tailrace.flow.shaping.redundancy import LengthStats, StepCost, allocate, by_spread
from tailrace.flow.shaping.select import dual_end
from tailrace.types import Prompt, Trajectory

if TYPE_CHECKING:
    from tailrace.flow.store import GroupState


_OPTIONS = ("window", "extra", "longest", "early_stop", "ema")


class Darts(Shaping):
    name = "darts"

    def __init__(
        self,
        window: int = 1,
        extra: float | None = 0.5,
        longest: int = 1,
        early_stop: float = 0.1,
        ema: float = 0.5,
    ) -> None:
        if extra is not None and not 0 <= extra <= 1:
            raise ValueError(
                f"shaping.extra={extra}: must lie in [0, 1] (a fraction of M x R extra samples), or null "
                "for the budget of least predicted round time"
            )
        if not 0 <= early_stop <= 1:
            raise ValueError(f"shaping.early_stop={early_stop}: must lie in [0, 1] (a fraction of R)")
        if longest < 0:
            raise ValueError(f"shaping.longest={longest}: must be >= 0")
        if not 0 < ema <= 1:
            raise ValueError(f"shaping.ema={ema}: must lie in (0, 1]")
        self.window, self.extra, self.longest, self.early_stop = window, extra, longest, early_stop
        self.stats = LengthStats(alpha=ema)
        self.cost = StepCost()  # the engines' decode steps
        self.train_cost = StepCost()  # the trainer's: a part per sample, per token, per squared length
        self.slots, self.engines = 0, 0  # the engines' rows in all and their number, as last reported
        self.overlap = False  # the mode trains while it generates (set_overlap)

    @classmethod
    def from_options(cls, **options) -> Darts:
        """The run's shaping options this one reads (the defaults are __init__'s)."""
        return cls(**{k: v for k, v in options.items() if k in _OPTIONS})

    def budget(
        self, prompts: Sequence[Prompt], m: int, var: list[float], order: list[int], early: int
    ) -> int:
        """Extra candidates for a window: the fixed share, or the least predicted round time's with the
        prompts raised in `order` and the first `early` of them stopping early (none before the
        engines' reports and a completed group say what a step and a response cost; a trained token
        priced at its average cost until the trainer's reports tell its parts apart, at nothing before
        them)."""
        if self.extra is not None:
            return round(self.extra * m * len(prompts))
        fit, s = self.cost.fit(), self.stats
        if fit is None or not s.cap or not self.slots:
            return 0
        train = self.train_cost.fit() or (0.0, self.train_cost.per_token_bound() or 0.0, 0.0)
        costs = Costs(*fit[:2], *train, self.engines, self.slots, self.overlap)
        means = [max(s.mean_length(p.id), 1.0) for p in prompts]
        runaway = min(s.truncated(), 0.5)  # the model needs q < 1; at half truncated no tail is left to cut
        return best_budget(means, var, s.cap, runaway, m, self.longest, early, costs, order)

    def plan(self, prompts: Sequence[Prompt], m: int) -> list[Plan]:
        if self.longest > m:
            raise ValueError(f"shaping.longest={self.longest}: must be <= flow.samples_per_prompt={m}")
        var = [self.stats.variance(p.id) for p in prompts]
        order, n_early = by_spread(var), round(self.early_stop * len(prompts))
        counts = allocate(var, m, self.budget(prompts, m, var, order, n_early))
        early = set([i for i in order if counts[i] == 2 * m][:n_early])
        return [Plan(n, i in early) for i, n in enumerate(counts)]

    def enough(self, g: GroupState) -> bool:
        return g.early_stop and sum(not t.truncated for t in g.done) >= g.size

    def select(self, g: GroupState) -> tuple[list[Trajectory], list[Trajectory]]:
        return dual_end(g.done, g.size, self.longest)

    def observe(self, g: GroupState) -> None:
        self.stats.observe(g.prompt.id, [t.length for t in g.done], sum(t.truncated for t in g.done))

    def observe_steps(
        self, steps: int, decode_tokens: int, prefill_tokens: int, busy_s: float, slots: int, engines: int
    ) -> None:
        self.cost.add(steps, decode_tokens, prefill_tokens, busy_s)
        self.slots, self.engines = slots, engines

    def observe_train(self, samples: int, tokens: int, squares: int, busy_s: float) -> None:
        self.train_cost.add(samples, tokens, squares, busy_s)

    def set_overlap(self, overlapped: bool) -> None:
        self.overlap = overlapped

    def state_dict(self) -> dict:
        return {
            "stats": self.stats.state_dict(), "cost": self.cost.state_dict(), "slots": self.slots,
            "engines": self.engines, "train_cost": self.train_cost.state_dict(),
        }  # fmt: skip

    def load_state_dict(self, d: dict) -> None:
        self.stats.load_state_dict(d["stats"])
        if "cost" in d:  # older checkpoints: no step cost yet
            self.cost.load_state_dict(d["cost"])
            self.slots = d["slots"]
        self.engines = d.get("engines", 1)  # older checkpoints: one engine, no trainer cost yet
        if "train_cost" in d:
            self.train_cost.load_state_dict(d["train_cost"])
