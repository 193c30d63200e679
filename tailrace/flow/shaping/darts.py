"""darts: dual-end sampling with adaptive redundancy (DARTS, TECHNIQUES.md §5).

Prompts are planned in windows of `window` (the round size R): an extra budget of
`extra` x M x R samples goes greedily to the prompts of largest estimated length variance, each
getting M'_i in [M, 2M] candidates (redundancy.py). A group waits for all its candidates, then trains
on the K shortest non-truncated plus the L longest (select.py; K + L = M); the rest are discards with
the reason `shaping`, and the reward of what is kept is never changed. The `early_stop` fraction of
a window's prompts with the largest variance (among those at 2M) stop at their first M
non-truncated finishers, and the core aborts the rest: the most expensive tails are never waited for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from tailrace.flow.shaping.base import Plan, Shaping
from tailrace.flow.shaping.redundancy import LengthStats, allocate
from tailrace.flow.shaping.select import dual_end
from tailrace.types import Prompt, Trajectory

if TYPE_CHECKING:
    from tailrace.flow.store import GroupState


class Darts(Shaping):
    name = "darts"

    def __init__(
        self, window: int = 1, extra: float = 0.5, longest: int = 1, early_stop: float = 0.1, ema: float = 0.5
    ) -> None:
        if not 0 <= extra <= 1:
            raise ValueError(f"shaping.extra={extra}: must lie in [0, 1] (a fraction of M x R extra samples)")
        if not 0 <= early_stop <= 1:
            raise ValueError(f"shaping.early_stop={early_stop}: must lie in [0, 1] (a fraction of R)")
        if longest < 0:
            raise ValueError(f"shaping.longest={longest}: must be >= 0")
        if not 0 < ema <= 1:
            raise ValueError(f"shaping.ema={ema}: must lie in (0, 1]")
        self.window, self.extra, self.longest, self.early_stop = window, extra, longest, early_stop
        self.stats = LengthStats(alpha=ema)

    @classmethod
    def from_options(
        cls,
        window: int = 1,
        extra: float = 0.5,
        longest: int = 1,
        early_stop: float = 0.1,
        ema: float = 0.5,
        **_,
    ) -> Darts:
        return cls(window, extra, longest, early_stop, ema)

    def plan(self, prompts: Sequence[Prompt], m: int) -> list[Plan]:
        if self.longest > m:
            raise ValueError(f"shaping.longest={self.longest}: must be <= flow.samples_per_prompt={m}")
        var = [self.stats.variance(p.id) for p in prompts]
        counts = allocate(var, m, round(self.extra * m * len(prompts)))
        full = sorted((i for i, n in enumerate(counts) if n == 2 * m), key=lambda i: (-var[i], i))
        early = set(full[: round(self.early_stop * len(prompts))])
        return [Plan(n, i in early) for i, n in enumerate(counts)]

    def enough(self, g: GroupState) -> bool:
        return g.early_stop and sum(not t.truncated for t in g.done) >= g.size

    def select(self, g: GroupState) -> tuple[list[Trajectory], list[Trajectory]]:
        return dual_end(g.done, g.size, self.longest)

    def observe(self, g: GroupState) -> None:
        self.stats.observe(g.prompt.id, [t.length for t in g.done])

    def state_dict(self) -> dict:
        return {"stats": self.stats.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.stats.load_state_dict(d["stats"])
