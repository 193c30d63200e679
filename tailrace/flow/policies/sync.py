"""sync: the slime/verl baseline. Generate R prompts x G samples (G: the group size) with fixed
weights, train on them in R/U optimizer steps, publish the new version, load it everywhere, repeat.
Strictly on-policy.
The whole round is handed to the engines at once (they queue what their slots cannot take), so a
fixed seed gives the same engine schedule, and the same metrics, run after run."""

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

    def decide(self, core: Scheduler) -> None:
        if not self.round:  # after a resume, the groups of the interrupted round are already there
            self.round = sorted(list(core.open) + list(core.ready))[: core.spec.groups_per_round]
        if not self.round:
            self._start_round(core)
            return
        groups = [core.open[g] for g in self.round if g in core.open]
        if groups:
            self.hand_over(core, groups)
            return
        U = core.spec.groups_per_step
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
