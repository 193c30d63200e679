"""sync: the slime/verl baseline. Generate R prompts x G samples (G: the group size) with fixed
weights, train on them in R/U optimizer steps, publish the new version, load it everywhere, repeat.
Strictly on-policy.
The whole round is handed to the engines at once (they queue what their slots cannot take), so a
fixed seed gives the same engine schedule, and the same metrics, run after run. For the same reason
zero-signal groups are replaced in waves: once a round is complete, its zero-signal groups (slot
order, within the round's allowance) are dropped and a wave of fresh prompts is handed over."""

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
            self.round, self.extra = sorted(list(core.open) + list(core.ready))[:R], 0
        if not self.round:
            self._start_round(core)
            return
        groups = [core.open[g] for g in self.round if g in core.open]
        if not groups:  # the round is complete: its zero-signal groups go, a wave replaces them
            self.extra += self.replace_zero_signal(
                core, self.round, self.allowance(core, R // U) - self.extra
            )
            groups = [core.open[g] for g in self.round if g in core.open]
        if groups:
            self.hand_over(core, groups)
            return
        for i in range(0, len(self.round), U):
            chunk = self.round[i : i + U]
            core.train(chunk, publish=i + U >= len(self.round))
        self.round = []

    def _start_round(self, core: Scheduler) -> None:
        v = core.trainer_version
        if core.steps_done < core.steps_issued or v not in core.published:
            return  # still training, or the new weights are not out yet
        if not self.sync_engines(core, v):
            return
        self.round = [core.open_group(v).id for _ in range(core.spec.groups_per_round)]
        core.mark("round_start", version=v, groups=list(self.round))
        self.hand_over(core, [core.open[g] for g in self.round])
