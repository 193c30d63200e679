"""Sync with SortedRL's early updates (shaping.name=sorted; the shaping side: flow/shaping/sortedrl.py).

A round (the rollout batch: shaping.over x R groups, in whole steps) is handed out at once, as in
sync. Every time U of its groups are complete and trainable, the first to complete make a step that
publishes new weights; engines load each new version and keep an old one while requests of it run.
The next round opens once every group of this one is in a step, under weights recent enough that
its last step stays within the bound K (when the round has more than K + 1 steps: under the newest).
A group that could no longer be trained within K (trainer version - its version > K) is given up
(deferred: its samples discarded, reason `shaping`) and its prompt opened again, in the same slot,
under the newest version all engines hold once that one is within K.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tailrace.flow.policies.sync import SyncPolicy
    from tailrace.flow.scheduler import Scheduler


class SortedRounds:
    def __init__(self, policy: SyncPolicy) -> None:
        self.p = policy
        self.issued: set[int] = set()  # groups of the round handed to a train step

    def decide(self, core: Scheduler) -> None:
        p, K = self.p, self.p.bound
        R, U = core.spec.groups_per_round, core.spec.groups_per_step
        held = self._load_newest(core)
        if not p.round:  # resumed mid-round: adopt what is there
            p.round = sorted([g for g in core.open if not core.open[g].deferred] + list(core.ready))
        if not p.round or all(g in self.issued for g in p.round):
            if held is not None:
                self._start_round(core, held)
            return
        T = core.trainer_version
        for gid in p.round:  # too stale to be trained ever: given up, generated again below
            g = core.open.get(gid) or core.ready.get(gid)
            if g is not None and not g.deferred and T - g.version > K:
                core.defer_group(gid)
        if held is not None and T - held <= K:
            for i, gid in enumerate(p.round):
                g = core.open.get(gid)
                if gid not in self.issued and gid not in core.ready and (g is None or g.deferred):
                    p.round[i] = core.open_group(held).id
            p.extra += p.replace_rejected(core, p.round, p.allowance(core, R // U) - p.extra)
            todo = [core.open[g] for g in p.round if g in core.open and core.open[g].todo]
            p.hand_over(core, todo, held)  # (after a resume: the samples in flight at the crash)
        while core.steps_issued < core.spec.total_steps:
            T = core.trainer_version  # each step issued moves it: the rest are judged against the new one
            ready = [
                g
                for g in p.round
                if g in core.ready and g not in self.issued and T - core.ready[g].version <= K
            ]
            if len(ready) < U:
                return
            batch = sorted(ready, key=lambda g: (core.ready[g].completed_at or 0.0, g))[:U]
            self.issued.update(batch)
            core.train(batch, publish=True)

    def _load_newest(self, core: Scheduler) -> int | None:
        """Load the newest version everywhere, drop older ones no request runs on; returns the newest
        version every engine holds (None while none is: engines that hold one version at a time hold
        nothing while they load)."""
        for e in core.engines:
            core.load(e.id, core.newest)
        if all(core.newest in e.loaded for e in core.engines):  # older ones go once none of theirs runs
            for e in core.engines:
                for old in [v for v in e.loaded if v < core.newest]:
                    core.drop(e.id, old)
        if not core.engines:
            return None
        return max(set.intersection(*(e.loaded for e in core.engines)), default=None)

    def _start_round(self, core: Scheduler, held: int) -> None:
        p = self.p
        U = core.spec.groups_per_step
        left = (core.spec.total_steps - core.steps_issued) * U  # the run's last batch: only what it trains
        n = min(left, max(U, core.shaping.round_open(core.spec.groups_per_round) // U * U))  # whole steps
        # the round's last step trains n/U - 1 versions after its first: start it under weights recent
        # enough that its groups stay within the bound to the end, when the bound allows (else fresh)
        lag = max(0, p.bound - (n // U - 1))
        if core.trainer_version - held > lag or core.steps_issued >= core.spec.total_steps:
            return  # the weights the round would use are too old for the trainer: wait for newer
        p.round, p.extra, self.issued = [core.open_group(held).id for _ in range(n)], 0, set()
        core.mark("round_start", version=held, groups=list(p.round), tail=False)
        p.hand_over(core, [core.open[g] for g in p.round], held)
