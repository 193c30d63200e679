"""async: K-step off-policy training with rounds (verl's one-step-off generalised to K).

Each round is one train step (U groups) generated entirely by one version: the newest published
when the round starts. Round r is trained from trainer version r, so it may start only once version
r - K is out — staleness is bounded by pacing admissions, never by discarding finished work. The next
round starts when the previous one's generation is complete, so generation of step r+1.. overlaps
the training of step r; engines switch weights only between rounds. A zero-signal group is swapped
for a fresh one in its round as soon as it completes (within the round's allowance), at the round's
version while engines hold it, else at a newer one (less stale).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailrace.flow.policies.base import Policy

if TYPE_CHECKING:
    from tailrace.flow.scheduler import Scheduler


class AsyncPolicy(Policy):
    name = "async"
    correction = "tis"  # whole samples K versions stale: truncated importance weights

    def __init__(self, max_staleness: int = 1) -> None:
        if max_staleness < 1:
            raise ValueError(f"async needs max_staleness >= 1 (got {max_staleness}); use mode sync for 0")
        self.max_staleness = max_staleness
        self.rounds: list[list[int]] = []  # generating or waiting to train, oldest first
        self.extras: list[int] = []  # zero-signal replacements of each round
        self.next_round = 0

    @classmethod
    def from_options(cls, max_staleness: int = 1, **_) -> "AsyncPolicy":
        return cls(max_staleness)

    def decide(self, core: Scheduler) -> None:
        if not self.rounds and (core.open or core.ready):  # resumed: adopt what is there
            self._adopt(core)
        for i, r in enumerate(self.rounds):
            self.extras[i] += self.replace_rejected(core, r, self.allowance(core) - self.extras[i])
        # train whole rounds in order, as soon as each is complete
        while self.rounds and all(g in core.ready for g in self.rounds[0]):
            self.extras.pop(0)
            core.train(self.rounds.pop(0), publish=True)
            self.next_round = max(self.next_round, core.steps_issued)
        generating = [g for r in self.rounds for g in r if g in core.open]
        if generating:
            self.fill(core, [core.open[g] for g in generating])
            return
        r = core.steps_issued + len(self.rounds)  # the step that will train the next round
        v = core.newest
        if r - v > self.max_staleness or r >= core.spec.total_steps:
            return  # too far ahead of the trainer: wait for newer weights
        if not self.sync_engines(core, v):
            return
        U = core.spec.groups_per_step
        self.rounds.append([core.open_group(v).id for _ in range(U)])
        self.extras.append(0)
        core.mark("round_start", version=v, step=r)
        self.fill(core, [core.open[g] for g in self.rounds[-1]])

    def _adopt(self, core: Scheduler) -> None:
        """Rounds of U groups, oldest version first: a round's groups then date from no earlier than
        the round started at (a replacement may be newer than its round)."""
        U = core.spec.groups_per_step
        groups = sorted([*core.open.values(), *core.ready.values()], key=lambda g: (g.version, g.id))
        self.rounds = [[g.id for g in groups[i : i + U]] for i in range(0, len(groups), U)]
        self.extras = [0] * len(self.rounds)
