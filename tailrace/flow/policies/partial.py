"""partial: partial rollout (Kimi k1.5 / AReaL style). Engines hold only the newest weights; at every
weight update the unfinished samples are aborted and resumed under the new version. Tokens keep the
version that produced them, so one trajectory carries several versions; the core bounds the oldest
(the group's dispatch version) by K, and the trainer masks any token more than K behind (it cannot
train a resumed sample's old segment unmasked — see tests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailrace.flow.policies.streaming import StreamingPolicy

if TYPE_CHECKING:
    from tailrace.flow.scheduler import Scheduler


class PartialPolicy(StreamingPolicy):
    name = "partial"
    mixed_versions = True
    # each token clipped against the behaviour logprob of the version that sampled it. Not `tis`: with one
    # optimizer step per batch its ratio anchor is the current weights (ratio 1, nothing clipped), and
    # on bench/modes.py balanced (3 seeds x 200 steps) partial under tis ended at 82.2% +- 10.8 (one seed
    # fell from 82.8% to 69.7% after step 120); under behaviour 88.2% +- 0.6, 0.54x sync's time to 84.5%
    correction = "behaviour"

    def decide(self, core: Scheduler) -> None:
        self.train_ready(core)
        v = core.newest
        for e in core.engines:
            core.load(e.id, v)
            stale = [sid for sid, sv in e.in_flight.items() if sv < v]
            if v in e.loaded and stale:
                core.abort(e.id, stale, "weight-update")  # the core sends each abort once
            for old in [x for x in e.loaded if x < v and v in e.loaded]:  # never left holding nothing
                core.drop(e.id, old)
        if all(v in e.loaded for e in core.engines):
            for g in self.pending(core):
                self.fill(core, [g], version=v)
            self.open_new(core, v)

    def version_for(self, core: Scheduler, g) -> int:
        return core.newest  # every sample continues under the newest weights

    def one_version_refusal(self) -> str | None:
        return (
            "aborts running samples once an engine holds the new version beside the old one; use "
            "flow.mode=multiversion with flow.placement=dedicated (each engine one version, DORA's), or "
            "rollout.backend=tailrace with rollout.max_versions=null"
        )

    def on_aborted(self, core: Scheduler, partial) -> None:
        """Resume the partial at once under the newest version any engine holds, on the holder of it
        with the most free slots (not necessarily the engine that returned it: its prefix is
        prefilled again wherever it goes)."""
        engine = max([e for e in core.engines if e.loaded], key=lambda e: (max(e.loaded), e.free))
        core.resume(engine.id, partial, max(engine.loaded))
