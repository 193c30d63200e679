"""The skeleton shared by the streaming modes (partial rollout and multi-version rollout).

Generation never stops for training: new prompts go to the newest loaded version, at most
`rollout_groups` groups per version (the rollout batch, larger than the train batch), and every
complete group joins the trainer FIFO; each optimizer step (U groups) publishes a new version.

The window: a step that would move the trainer to version T+1 is issued only if every group not in
it (or in an earlier step) was opened at version >= T+1-K. So when the oldest version's groups are
not all collected, the trainer waits rather than a trajectory being dropped or going stale (C2, C3).
Groups of the oldest version are trained first, then in completion order; admission opens no more
groups of a version than the steps left before it goes stale can take, so the wait always ends.

How far ahead: by default admission opens groups up to the staleness window. When training is the
bottleneck that only ages the queue: samples wait in it until they are K versions old, and a step
learns less from them (and a step issued to a busy trainer is as stale as the steps queued before
it). `ahead=A` issues a step only while the trainer has at most A issued steps not done, and opens
no group while A train steps' worth of groups (or, if more, the groups that fill every engine slot)
are queued, open or complete, not yet in a step: the trainer still finds its next batch, the engines
idle when they are ahead (the trainer sets the pace anyway), and samples are trained younger.

A zero-signal group is dropped as soon as it is ready (at most `allowance` between two train steps)
and frees its place in its version's rollout batch; admission opens a fresh group for it, at the
newest version.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tailrace.flow.policies.base import Policy
from tailrace.flow.store import GroupState

if TYPE_CHECKING:
    from tailrace.flow.scheduler import Scheduler


class StreamingPolicy(Policy):
    def __init__(
        self, max_staleness: int = 1, rollout_groups: int | None = None, ahead: int | None = None
    ) -> None:
        if max_staleness < 1:
            raise ValueError(
                f"{self.name} needs max_staleness >= 1 (got {max_staleness}); use sync or pipe for 0"
            )
        self.max_staleness = max_staleness
        self.rollout_groups = rollout_groups  # None = max(R, 2U): more than one train step per version
        if ahead is not None and ahead < 0:
            raise ValueError(f"ahead={ahead}: must be >= 0 train steps, or None for the staleness bound")
        self.ahead = ahead

    @classmethod
    def from_options(
        cls, max_staleness: int = 1, rollout_groups: int | None = None, ahead: int | None = None, **_
    ):
        return cls(max_staleness, rollout_groups, ahead)

    # -- training -------------------------------------------------------------------------------
    def train_ready(self, core: Scheduler) -> None:
        """Drop zero-signal groups (within the allowance), then issue every step the window allows."""
        for g in list(core.ready.values()):
            if self.drop_rejected(core, g):  # admission opens a fresh group in its place
                self.opened_at[g.version] = self.opened_at.get(g.version, 0) - 1
        U, K = core.spec.groups_per_step, self.max_staleness
        while core.steps_issued < core.spec.total_steps:
            if self.ahead is not None and core.steps_issued - core.steps_done > self.ahead:
                return  # the trainer has its next steps queued: a batch chosen later is fresher
            ready = sorted(core.ready.values(), key=_first_completed)
            if len(ready) < U:
                return
            batch = {g.id for g in ready[:U]}
            rest = [g.version for g in core.queued() if g.id not in batch]
            if not _trainable_later(rest, U, K, core.trainer_version + 1):
                core.mark("window_wait", oldest=min(rest), trainer=core.trainer_version)
                return
            core.train([g.id for g in ready[:U]], publish=True)

    # -- admission ------------------------------------------------------------------------------
    def open_new(self, core: Scheduler, version: int) -> None:
        """Open groups at `version` while engines holding it have room and its rollout batch is not
        full — and only as many as the steps left before `version` goes stale can train: every group
        of version <= v must be trained by a step starting at trainer version <= v + K, and each step
        takes U groups (oldest first). Without this bound the window could wait forever on a group
        that no step may take."""
        cap = self.rollout_groups or max(core.spec.groups_per_round, 2 * core.spec.groups_per_step)
        U, K = core.spec.groups_per_step, self.max_staleness
        per_group = core.spec.samples_per_prompt
        room = sum(e.free for e in core.engines if version in e.loaded)
        needed = core.spec.total_steps * U + sum(core.groups_dropped.values())
        queued = [g.version for g in core.queued()]
        budget = min(
            U * (v + K - core.trainer_version + 1) - sum(1 for x in queued if x <= v)
            for v in set(queued) | {version}
            if v >= version
        )
        if self.ahead is not None:
            fill = -(-sum(e.slots for e in core.engines) // per_group)  # groups that fill every slot
            budget = min(budget, max(self.ahead * U, fill) - len(queued))
        while (
            self.opened_at.get(version, 0) < cap
            and room >= per_group
            and core.groups_opened - core.groups_withdrawn < needed
            and budget > 0
        ):
            g = core.open_group(version)
            self.opened_at[version] = self.opened_at.get(version, 0) + 1
            room -= per_group
            budget -= 1
            self.fill(core, [g])

    def attach(self, core: Scheduler) -> None:
        super().attach(core)
        self.opened_at: dict[int, int] = {}  # groups this policy opened per version (less dropped)

    def pending(self, core: Scheduler) -> list[GroupState]:
        """Open groups with samples still to dispatch, oldest version first."""
        return sorted((g for g in core.open.values() if g.todo), key=lambda g: (g.version, g.id))


def _trainable_later(versions: list[int], U: int, K: int, T: int) -> bool:
    """Can groups of these versions all be trained by steps starting at trainer versions T, T+1, ...
    (U groups a step, oldest first) without any going more than K versions stale? For every v, the
    groups of version <= v must fit in the (v + K - T + 1) steps that may still take them."""
    below = 0
    for v in sorted(set(versions)):
        below += versions.count(v)
        if below > U * max(0, v + K - T + 1):
            return False
    return True


def _first_completed(g) -> tuple:
    """Oldest version first, then first completed (None: from a checkpoint, so before any other)."""
    return (g.version, -math.inf if g.completed_at is None else g.completed_at, g.id)
