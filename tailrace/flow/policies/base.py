"""The policy interface. A policy decides; the scheduler core books and checks.

    attach(core)                 once, when the scheduler is built
    decide(core)                 at every poll: open groups, dispatch, abort, train, load, drop
    on_aborted(core, partial)    an aborted partial came back: core.resume(...) or core.discard_partial(...)
    state_dict / load_state_dict what the policy needs to resume (most derive everything from the core)

Class attributes declare the invariants the core enforces at every train step:
`max_staleness` (trainer version - oldest token version) and `mixed_versions`; and `correction`, the
off-policy correction (a `trainer.losses.CORRECTIONS` name) a run of the mode trains with unless
`train.loss.correction` names another: the one its time-to-accuracy runs were measured with
(bench/modes.py).

The store's entry filter (`entry`, flow/filters.py; set by `make_policy`): a complete group it rejects
(zero-signal: every reward equal, no advantage, DAPO's dynamic sampling; or refused by the user's
`store.filter`) is dropped with the filter's reason (`core.drop_group`) and each policy generates a
fresh prompt in its place, at most `extra_groups` more groups per optimizer step (0 = off); past that
bound they are trained as they are, so every step still has its U groups and the run its steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailrace.flow.filters import EntryFilter
from tailrace.flow.store import GroupState
from tailrace.types import Capabilities, Trajectory

if TYPE_CHECKING:
    from tailrace.flow.scheduler import Scheduler


class Policy:
    name = "base"
    max_staleness = 0
    mixed_versions = False
    correction = "none"  # on-policy: the trainer's own logprobs anchor the ratio
    extra_groups: int | None = 0  # rejected groups replaced per optimizer step at most (None = U)
    entry = EntryFilter()  # the store's entry filter: which complete groups leave untrained
    publishes_per_round = False  # sync, pipe: a round's steps publish one version, at its end
    external = False  # its groups come from an external agent (`Scheduler.submit_group`), not its own

    @classmethod
    def own_correction(cls, steps_per_round: int, replay: bool = False) -> str:
        """The correction a run of this mode trains with where train.loss.correction is null, for
        rounds of `steps_per_round` optimizer steps (R / U). Where a round publishes once and has
        several steps, its later steps train after the weights moved (unpublished, so its samples
        count 0 versions stale): they clip against the behaviour policy, as verl's mini-batches clip
        against the rollout's logprobs; a one-step round is exactly on-policy. Replayed groups
        (`replay`: the store replays) are off-policy in any mode: behaviour as well."""
        if cls.correction == "none" and (replay or (cls.publishes_per_round and steps_per_round > 1)):
            return "behaviour"
        return cls.correction

    @classmethod
    def from_options(cls, **options) -> "Policy":
        """Build from run options (e.g. max_staleness); a policy reads only the ones it has."""
        return cls()

    def attach(self, core: Scheduler) -> None:
        self.core = core

    def external_room(self, core: Scheduler) -> int | None:
        """An external agent's requests the engines may take now (None: all of them)."""
        return None

    def one_version_refusal(self) -> str | None:
        """Why this policy cannot run on engines that hold one version at a time, and the fix (None: it
        can; the core then loads a new version into an engine only once it has drained)."""
        return None

    def refusal(self, capabilities: Capabilities) -> str | None:
        """One line saying why this policy cannot run on engines with these capabilities, with the fix;
        None when it can. The scheduler refuses such a policy; the CLI says so before anything starts."""
        why = self.one_version_refusal() if capabilities.versions_at_once == 1 else None
        if why is None:
            return None
        return (
            f"flow.mode={self.name} {why}, and the rollout engines hold one weight version at a time "
            "(versions_at_once=1: rollout.backend=vllm, or rollout.max_versions=1)"
        )

    def decide(self, core: Scheduler) -> None:
        raise NotImplementedError

    def on_aborted(self, core: Scheduler, partial: Trajectory) -> None:
        core.discard_partial(partial, "aborted")

    def version_for(self, core: Scheduler, g: GroupState) -> int | None:
        """The version `g`'s pending samples will be dispatched under (the core has some engine load it
        when the engines holding it left); None: none in particular."""
        return g.version

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass

    # -- helpers shared by policies -------------------------------------------------------------
    @staticmethod
    def fill(core: Scheduler, groups: list[GroupState], version: int | None = None) -> None:
        """Dispatch pending samples of `groups`, in order, to engines that hold their version,
        spreading across engines by free capacity."""
        for g in groups:
            v = g.version if version is None else version
            while g.todo:
                engines = [e for e in core.engines if v in e.loaded and e.free > 0]
                if not engines:
                    break
                e = max(engines, key=lambda e: (e.free, -e.id))
                core.dispatch(e.id, g, 1, version=v)

    @staticmethod
    def hand_over(core: Scheduler, groups: list[GroupState], version: int | None = None) -> None:
        """Dispatch every pending sample of `groups` now (under `version`, default each group's own),
        round-robin over engines holding it, past their free capacity (the engines queue them)."""
        i = 0
        for g in groups:
            v = g.version if version is None else version
            while g.todo:
                engines = [e for e in core.engines if v in e.loaded]
                if not engines:  # every holder left: the core has a joined engine load it
                    return
                core.dispatch(engines[i % len(engines)].id, g, 1, version=v, queue_all=True)
                i += 1

    _dropped_at = (0, 0)  # (steps issued when counted, rejected groups dropped since)

    def drop_rejected(self, core: Scheduler, g: GroupState) -> bool:
        """Drop ready group `g` if the entry filter rejects it and this step's allowance has room
        (counted from the last step issued); True if it was dropped. For modes that drop such groups
        from the store and let admission open fresh ones in their place (the streaming modes, an
        agent's groups)."""
        step, dropped = self._dropped_at
        if step != core.steps_issued:
            step, dropped = core.steps_issued, 0
        if dropped >= self.allowance(core):
            return False
        reason = self.entry.reason(g)
        if reason is None:
            return False
        core.drop_group(g.id, reason)
        self._dropped_at = (step, dropped + 1)
        return True

    @staticmethod
    def round_size(core: Scheduler) -> int:
        """Groups the next round trains: R, or those of the steps left when fewer (flow.steps need not
        be a multiple of a round's R / U steps; the last round is cut, not finished past the run)."""
        left = (core.spec.total_steps - core.steps_issued) * core.spec.groups_per_step
        return max(0, min(core.spec.groups_per_round, left))

    def allowance(self, core: Scheduler, steps: int = 1) -> int:
        """Replacement groups `steps` optimizer steps may open."""
        per_step = core.spec.groups_per_step if self.extra_groups is None else self.extra_groups
        return per_step * steps

    def replace_rejected(self, core: Scheduler, slots: list[int], allowance: int) -> int:
        """Swap each ready group of `slots` the entry filter rejects (in slot order, at most
        `allowance`) for a fresh group in the same slot, at its version while an engine still holds it
        (else the newest an engine holds: fresher, so never staler). Returns how many were swapped."""
        n = 0
        for i, gid in enumerate(slots):
            if n >= allowance:
                break
            g = core.ready.get(gid)
            reason = None if g is None else self.entry.reason(g)
            if reason is None:
                continue
            held = {v for e in core.engines for v in e.loaded}
            core.drop_group(gid, reason)
            slots[i] = core.open_group(g.version if g.version in held or not held else max(held)).id
            n += 1
        return n

    @staticmethod
    def sync_engines(core: Scheduler, version: int) -> bool:
        """Load `version` everywhere and drop older idle versions; True once every engine holds it
        (and there is one)."""
        for e in core.engines:
            core.load(e.id, version)
            for old in [v for v in e.loaded if v < version]:
                core.drop(e.id, old)
        return bool(core.engines) and all(version in e.loaded for e in core.engines)
