"""sync: the slime/verl baseline. Generate R prompts x G samples (G: the group size) with fixed
weights, train on them in R/U optimizer steps, publish the new version, load it everywhere, repeat.
Strictly on-policy.
The whole round is handed to the engines at once (they queue what their slots cannot take), so a
fixed seed gives the same engine schedule, and the same metrics, run after run. For the same reason
zero-signal groups are replaced in waves: once a round is complete, its zero-signal groups (slot
order, within the round's allowance) are dropped and a wave of fresh prompts is handed over.
A round-based shaping (tailbatch) may open more groups than R and keep the first R to complete: the
moment R are complete, the others are deferred (their prompts go to shaping's tail queue), and a tail
round on deferred prompts is waited for in full."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailrace.flow.policies.base import Policy

if TYPE_CHECKING:
    from tailrace.flow.scheduler import Scheduler


class SyncPolicy(Policy):
    name = "sync"
    max_staleness = 0

    def __init__(self) -> None:
        self.round: list[int] = []  # group ids of the round being generated
        self.extra = 0  # zero-signal replacements this round

    def decide(self, core: Scheduler) -> None:
        R, U = core.spec.groups_per_round, core.spec.groups_per_step
        if not self.round:  # after a resume, the groups of the interrupted round are already there
            live = [g for g in core.open if not core.open[g].deferred] + list(core.ready)
            self.round, self.extra = sorted(live), 0
        if not self.round:
            self._start_round(core)
            return
        self._cut(core, core.shaping.round_keep(R))
        groups = self._generating(core)
        if not groups:  # the round is complete: its zero-signal groups go, a wave replaces them
            self.extra += self.replace_zero_signal(
                core, self.round, self.allowance(core, R // U) - self.extra
            )
            groups = self._generating(core)
        if groups:
            self.hand_over(core, groups)
            return
        kept = [g for g in self.round if g in core.ready]
        for i in range(0, len(kept), U):
            core.train(kept[i : i + U], publish=i + U >= len(kept))
        self.round = []

    def _generating(self, core: Scheduler) -> list:
        return [core.open[g] for g in self.round if g in core.open and not core.open[g].deferred]

    def _cut(self, core: Scheduler, keep: int | None) -> None:
        """Once `keep` groups of a (non-tail) round are complete, defer the rest: the groups still
        generating, and any completed in the same poll after the first `keep`."""
        live = [core.open.get(g) or core.ready.get(g) for g in self.round]
        if keep is None or any(g.tail for g in live if g is not None):
            return
        ready = sorted(
            (g for g in self.round if g in core.ready), key=lambda g: (core.ready[g].completed_at, g)
        )
        if len(ready) < keep:
            return
        for g in [g.id for g in self._generating(core)] + ready[keep:]:
            core.defer_group(g)

    def _start_round(self, core: Scheduler) -> None:
        v = core.trainer_version
        if core.steps_done < core.steps_issued or v not in core.published:
            return  # still training, or the new weights are not out yet
        if not self.sync_engines(core, v):
            return
        n = core.shaping.round_open(core.spec.groups_per_round)
        self.round = [core.open_group(v).id for _ in range(n)]
        tail = any(core.open[g].tail for g in self.round)
        core.mark("round_start", version=v, groups=list(self.round), tail=tail)
        self.hand_over(core, [core.open[g] for g in self.round])
