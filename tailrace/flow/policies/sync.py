"""sync: the slime/verl baseline. Generate R prompts x G samples (G: the group size) with fixed
weights, train on them in R/U optimizer steps, publish the new version, load it everywhere, repeat.
Strictly on-policy.
The whole round is handed to the engines at once (they queue what their slots cannot take), so a
fixed seed gives the same engine schedule, and the same metrics, run after run. For the same reason
zero-signal groups are replaced in waves: once a round is complete, its zero-signal groups (slot
order, within the round's allowance) are dropped and a wave of fresh prompts is handed over.

Round-based shapings open more groups than R and train the first R to complete (`round_keep`); the
moment R are complete, the rest of the round is
- deferred (tailbatch): their prompts go to shaping's tail queue; a tail round is waited for in full;
- carried (april): into the next round, complete groups as they are, open ones with their unfinished
  samples aborted, parked and resumed under the new weights. Then the bound is `max_staleness` (not
  0) and a trajectory may mix versions; a group that could not be carried again within the bound is
  trained in its round, which waits for it.
With shaping sorted, a round's groups are trained as they complete (flow/policies/sorted.py)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tailrace.flow.policies.base import Policy
from tailrace.flow.policies.sorted import SortedRounds

if TYPE_CHECKING:
    from tailrace.flow.scheduler import Scheduler
    from tailrace.flow.store import GroupState
    from tailrace.types import Trajectory


class SyncPolicy(Policy):
    name = "sync"
    publishes_per_round = True

    max_staleness = 0

    def __init__(self, max_staleness: int = 1, pregen_below: float | None = None) -> None:
        self.round: list[int] = []  # group ids of the round being generated
        self.version = 0  # the round's version
        self.extra = 0  # zero-signal replacements this round
        self.carried: list[int] = []  # groups carried into the next round (a carrying shaping)
        self.bound = max_staleness  # a carrying shaping's staleness bound
        self.cut = False  # this round's cut is made (once: zero-signal replacements come after it)
        self.pregen_below = pregen_below  # pre-generate the next round once this share of slots is busy
        self.pregen_todo: list | None = None  # next round's prompts not yet pre-generated (None: not yet)

    @classmethod
    def from_options(cls, max_staleness: int = 1, pregen_below: float | None = None, **_) -> SyncPolicy:
        return cls(max_staleness, pregen_below)

    def attach(self, core: Scheduler) -> None:
        super().attach(core)
        if core.shaping.early_updates:
            if self.bound < 1:
                raise ValueError(
                    f"shaping.name={core.shaping.name} trains a round's groups under newer weights, so sync "
                    f"needs max_staleness >= 1 (got {self.bound})"
                )
            self.max_staleness, self.sorted = self.bound, SortedRounds(self)
        if core.shaping.carries:
            if self.bound < 1:
                raise ValueError(
                    f"shaping.name={core.shaping.name} carries groups into the next round, so sync needs "
                    f"max_staleness >= 1 (got {self.bound})"
                )
            self.max_staleness, self.mixed_versions = self.bound, True

    def decide(self, core: Scheduler) -> None:
        if core.shaping.early_updates:
            self.sorted.decide(core)
            return
        # the groups a round trains: R, or fewer in the run's last round (no step is issued before the
        # round is complete, so this stays the round's own until it trains)
        R, U = self.round_size(core), core.spec.groups_per_step
        if not self.round and not self.carried:  # resumed: the interrupted round's groups are there
            live = [g for g in core.open if not core.open[g].deferred] + list(core.ready)
            self.round, self.extra, self.version, self.cut = sorted(live), 0, core.trainer_version, False
        if not self.round:
            self._start_round(core)
            return
        self._cut(core, core.shaping.round_keep(R))
        groups = self._generating(core)
        if not groups:  # the round is complete: its zero-signal groups go, a wave replaces them
            self.extra += self.replace_rejected(core, self.round, self.allowance(core, R // U) - self.extra)
            groups = self._generating(core)
        if groups:
            self.hand_over(core, groups, self.version)
            self._pregen(core, groups)
            return
        kept = [g for g in self.round if g in core.ready][:R]  # (the last round: its steps only)
        for i in range(0, len(kept), U):
            core.train(kept[i : i + U], publish=i + U >= len(kept))
        self.round = []

    def version_for(self, core: Scheduler, g: GroupState) -> None:
        """None: a round's samples go under the newest weights, which an engine that joins loads (a
        group carried into the next round goes under that round's)."""
        return None

    def on_aborted(self, core: Scheduler, partial: Trajectory) -> None:
        if core.shaping.carries:  # a carried group's sample: resumed in the next round
            core.park(partial)
        else:
            super().on_aborted(core, partial)

    def _pregen(self, core: Scheduler, groups: list[GroupState]) -> None:
        """BubbleSpec: once the round's running samples fill at most `pregen_below` of the slots, the
        idle slots generate the next round's prompts (one response each) under this round's weights;
        the engines' history drafters draft from them when the next round generates those prompts."""
        per_round = core.spec.groups_per_round // core.spec.groups_per_step
        if self.pregen_below is None or core.steps_issued + per_round >= core.spec.total_steps:
            return  # off, or no round after this one
        running = sum(len(g.in_flight) for g in groups)
        if running > self.pregen_below * sum(e.slots for e in core.engines):
            return
        if self.pregen_todo is None:  # the bubble opens: the next round's prompts, one response each
            self.pregen_todo = core.peek(core.spec.groups_per_round)  # (a tail round's come from shaping)
        for e in core.engines:  # as slots free up, never past them: real samples never wait behind
            n = max(0, e.slots - len(e.in_flight) - core.pregen_in_flight(e.id))
            if self.pregen_todo and n and self.version in e.loaded:
                core.pregen(e.id, self.pregen_todo[:n], self.version)
                self.pregen_todo = self.pregen_todo[n:]

    def _generating(self, core: Scheduler) -> list[GroupState]:
        return [core.open[g] for g in self.round if g in core.open and not core.open[g].deferred]

    def _cut(self, core: Scheduler, keep: int | None) -> None:
        """Once `keep` groups of a (non-tail) round are complete, the rest of the round is deferred or
        carried: the groups still generating, and any completed in the same poll after the first
        `keep`. A carrying shaping first waits for the groups that must be trained in this round."""
        live = [core.open.get(g) or core.ready.get(g) for g in self.round]
        if self.cut or keep is None or any(g.own for g in live if g is not None):
            return
        done_at = {
            g: core.ready[g].completed_at for g in self.round if g in core.ready
        }  # None: from a checkpoint, so first
        ready = sorted(done_at, key=lambda g: (-math.inf if done_at[g] is None else done_at[g], g))
        if len(ready) < keep:
            return
        if not core.shaping.carries:
            for g in [g.id for g in self._generating(core)] + ready[keep:]:
                core.defer_group(g)
            self.cut = True
            return
        must = [
            g for g in self.round if core.trainer_version + 1 - live[self.round.index(g)].version > self.bound
        ]
        if any(g not in core.ready for g in must):
            return
        kept = must + [g for g in ready if g not in must][: keep - len(must)]
        self.carried = [g for g in self.round if g not in kept]
        self.round, self.cut = kept, True
        for g in self.carried:
            ids = {str(k) for k in core.open[g].in_flight} if g in core.open else set()
            for e in core.engines:
                core.abort(e.id, sorted(ids & e.in_flight.keys()), "carry")
        core.mark("round_cut", kept=kept, carried=list(self.carried))

    def _start_round(self, core: Scheduler) -> None:
        v = core.trainer_version
        if core.steps_done < core.steps_issued or v not in core.published:
            return  # still training, or the new weights are not out yet
        core.abort_pregen()  # the round it drafts for starts now: what came back so far still drafts
        if core.in_flight() or not self.sync_engines(core, v):
            return  # carried samples still coming back, or the weights not loaded yet
        carried = [g for g in self.carried if g in core.open or g in core.ready]
        R, U = self.round_size(core), core.spec.groups_per_step
        if not R:
            return  # stopped: no step left
        last = core.shaping.carries and core.steps_issued + R // U >= core.spec.total_steps
        n = max(0, (R if last else core.shaping.round_open(R)) - len(carried))  # last: none to carry into
        self.round, self.carried, self.version = carried + [core.open_group(v).id for _ in range(n)], [], v
        self.cut = last  # the last round waits for every group: nothing is left over
        self.pregen_todo = None
        tail = any(core.open[g].own for g in self.round if g in core.open)
        core.mark("round_start", version=v, groups=list(self.round), tail=tail, carried=len(carried))
        engines = [e.id for e in core.engines]
        parked = [p for g in carried if g in core.open for p in list(core.open[g].parked)]
        for i, p in enumerate(parked):  # the carried partials first: they are closest to done
            core.resume(engines[i % len(engines)], p, v)
        self.hand_over(core, self._generating(core), v)
