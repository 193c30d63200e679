"""The scheduler's engine books (a mixin of `Scheduler`, kept apart so each file holds one concern):
engines lost, joining, starting, leaving, lent to another policy and taken back; their in-flight
samples requeued; the versions restored groups need on resume; weights provisioned for a changing
engine set. Pure, as the core is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tailrace.flow.external import is_external
from tailrace.flow.keys import SampleKey
from tailrace.flow.store import GroupState

if TYPE_CHECKING:
    from tailrace.flow.scheduler import Scheduler


class InvariantError(AssertionError):
    pass


@dataclass
class EngineState:
    id: int
    slots: int
    lookahead: int  # requests queued beyond the slots, so a freed slot never waits for the driver
    loaded: set[int] = field(default_factory=lambda: {0})
    loading: set[int] = field(default_factory=set)
    in_flight: dict[str, int] = field(default_factory=dict)  # request id -> version
    versions_at_once: int | None = None  # its `Capabilities.versions_at_once`

    @property
    def capacity(self) -> int:
        return self.slots + self.lookahead

    @property
    def free(self) -> int:
        return max(0, self.capacity - len(self.in_flight))

    def count(self, version: int) -> int:
        return sum(1 for v in self.in_flight.values() if v == version)


class EngineBook:
    def on_engine_lost(self, engine: int, now: float) -> int:
        """An engine died (or was killed for not answering) with work in flight: every request it held
        goes back to its group's to-do list, to be dispatched again like a fresh sample (its tokens so
        far are gone with the process). Nothing was produced, so the ledger is unchanged; the engine
        keeps the versions it held (its replacement loads them) and its capacity. Returns how many
        samples were requeued."""
        self.now = now
        if engine in self.departed:  # it left first: its samples were requeued then
            return 0
        lost = self._requeue(self._by_id[engine])
        self.mark("engine_lost", engine=engine, requeued=lost)
        return lost

    def add_engine(self, slots: int, lookahead: int, started: bool = True) -> int:
        """An engine joins the running job: a new id (never one that was used), its slots and local
        queue, the run's engine capabilities, holding no weights. The next poll has it load what the
        policy needs (`_provision`), and from then on the policy gives it work like any other. Returns
        its id. `started=False`: its process is still building its engine (a slow starter takes
        seconds, during which newer versions replace what it would be asked to load); it gets no order
        until `engine_started`."""
        eid = max(self._by_id, default=-1) + 1
        ones = self.capabilities.versions_at_once
        self._by_id[eid] = EngineState(eid, slots, lookahead, loaded=set(), versions_at_once=ones)
        if not started:
            self.starting.add(eid)
        self._see_engines()
        self.mark("engine_joined", engine=eid, slots=slots)
        return eid

    def engine_started(self, engine: int) -> None:
        """A joined engine is up (its process said so): from the next poll it loads and gets work.
        One that left while starting stays gone."""
        if engine in self.departed:
            return
        if engine not in self.starting:
            raise InvariantError(f"engine {engine} was not starting")
        self.starting.discard(engine)
        self._see_engines()
        self.mark("engine_started", engine=engine)

    def remove_engine(self, engine: int, now: float) -> int:
        """An engine leaves the job gracefully. It does not drain: its in-flight samples go back to
        their groups' to-do lists at once, exactly as a lost engine's do (the tokens it generated for
        them are not used), so a leave takes one message however long its samples are. It is never
        given work again, and whatever it still reports (results, loads that crossed the leave) is
        ignored. Returns how many samples were requeued."""
        self.now = now
        if engine in self.departed or engine not in self._by_id:
            raise InvariantError(f"engine {engine} cannot leave: it is not in the job")
        self.departed.add(engine)  # first: the requeue's own aborts (shaping's cuts) skip it
        self.starting.discard(engine)
        self.engines = tuple(e for e in self.engines if e.id != engine)
        requeued = self._requeue(self._by_id[engine])
        self._pending.pop(engine, None)  # requests booked for it this poll are requeued with the rest
        self._out.commands = [c for c in self._out.commands if getattr(c, "engine", None) != engine]
        self.mark("engine_left", engine=engine, requeued=requeued)
        return requeued

    def mirror_engines(self, other: Scheduler) -> None:
        """A policy joining a running job (flow/multi.py's `PolicySet.add`), before its first poll: its
        engine books take `other`'s ids (those that left too: ids are never reused), holding none of
        its weights, so its first poll loads its start version everywhere (`_provision`)."""
        if self.groups_opened or self.steps_issued:
            raise InvariantError("mirror_engines: the policy has already started")
        ones = self.capabilities.versions_at_once
        self._by_id = {
            i: EngineState(i, e.slots, e.lookahead, loaded=set(), versions_at_once=ones)
            for i, e in other._by_id.items()
        }
        self.departed, self.starting = set(other.departed), set(other.starting)
        self._see_engines()

    def lend_engine(self, engine: int) -> None:
        """(Several policies on engines that hold one weight version at a time: flow/multi.py) engine
        `engine`, idle for this policy (nothing in flight, loading or pre-generating), serves another
        policy for now: it leaves this policy's view and its books hold none of this policy's weights
        (the other policy's will replace them) until `take_engine` gives it back."""
        if not self.can_lend(engine):
            raise InvariantError(f"engine {engine} cannot be lent: it has work of this policy")
        self.lent.add(engine)
        self.engine(engine).loaded.clear()
        self._see_engines()

    def can_lend(self, engine: int) -> bool:
        """Engine `engine` has nothing of this policy's: none in flight, loading, pre-generating or booked."""
        e = self.engine(engine)
        return not (e.in_flight or e.loading or self.pregen_in_flight(engine) or self._pending.get(engine))

    def take_engine(self, engine: int, loaded: set[int]) -> None:
        """A lent engine serves this policy again, holding `loaded` of its versions (none: the next poll
        loads what the policy needs, as for an engine that joined)."""
        if engine not in self.lent:
            raise InvariantError(f"engine {engine} was not lent")
        self.lent.discard(engine)
        self._by_id[engine].loaded = set(loaded)
        self._see_engines()

    def _see_engines(self) -> None:
        hidden = self.departed | self.lent | self.starting
        self.engines = tuple(e for e in self._by_id.values() if e.id not in hidden)

    def engine(self, engine: int) -> EngineState:
        """A live engine's books, by id (ids are never reused)."""
        if engine in self.departed:
            raise InvariantError(f"engine {engine} has left the job")
        return self._by_id[engine]

    def _requeue(self, eng: EngineState) -> int:
        """Every request `eng` holds goes back to its group's to-do list (generated again from its
        prompt); its pre-generation is dropped (drafts only). The ledger is unchanged: nothing was
        produced. Returns how many samples were requeued."""
        lost = list(eng.in_flight)
        eng.in_flight.clear()  # first: a group the requeue completes aborts nothing on this engine
        for rid in lost:
            if is_external(rid):  # an agent's: generated again elsewhere
                self._aborting.discard(rid)
                self.external.requeue(rid)
                continue
            key = SampleKey.parse(rid)
            self._aborting.discard(rid)
            self._seeds.pop(rid, None)
            self._episodes.pop((key.group, key.index), None)  # generated again from its prompt
            self._requeue_sample(self._store.open[key.group], key)
        eng.loading.clear()
        for rid in [rid for rid, (e, _) in self._pregen.items() if e == eng.id]:  # drafts only: gone
            del self._pregen[rid]
            self._aborting.discard(rid)
        return len(lost)

    def _requeue_sample(self, g: GroupState, key: SampleKey) -> None:
        """Sample `key` of `g` is no longer in flight and goes back to the to-do list (unless shaping
        had given it up): dispatched again like a fresh sample."""
        rid = str(key)
        g.in_flight.discard(key)
        g.dispatched -= 1
        if rid in self._cut:  # shaping had given it up: not generated again
            self._cut.discard(rid)
            self._maybe_ready(g)
        elif key.index not in g.todo:
            g.todo.append(key.index)
            g.todo.sort()

    def pending_versions(self) -> set[int]:
        """The versions open groups' pending samples are to be dispatched under (`Policy.version_for`)."""
        out = set()
        for g in self._store.open.values():
            v = self.policy.version_for(self, g) if (g.todo or g.parked) and not g.deferred else None
            if v is not None:
                out.add(v)
        return out

    def restore_version(self, version: int) -> None:
        """(Resume) an older version's weights are back, from a kept checkpoint: every engine starts
        holding it, for the restored groups of that version."""
        self.published.add(version)
        for e in self.engines:
            e.loaded.add(version)

    def restart_groups(self, versions: set[int], version: int) -> int:
        """(Resume) open groups of `versions` with samples to do, whose weights are gone: each starts
        over under `version`, its finished samples discarded (reason "resumed"). Returns how many."""
        n = 0
        for gid, g in list(self._store.open.items()):
            if g.version not in versions or not (g.todo or g.parked) or g.deferred:
                continue
            self.ledger.on_discarded("resumed", len(g.done))
            self._store.open[gid] = GroupState(
                g.id, g.prompt, version, g.size, g.opened, candidates=g.candidates,
                early_stop=g.early_stop, own=g.own,
            )  # fmt: skip
            self.mark("group_restarted", group=gid, version=version, was=g.version, discarded=len(g.done))
            n += 1
        return n

    def _provision(self) -> None:
        """Weights for a changing engine set: an engine that holds nothing (it joined) loads the newest
        version, and a version some group's pending samples need (`Policy.version_for`) that no live
        engine holds or is loading (its holders left) is loaded on the engine with the most room."""
        if not self.engines:
            return
        for e in self.engines:
            if not e.loaded and not e.loading:
                self.load(e.id, self.newest)
        held = {v for e in self.engines for v in e.loaded | e.loading}
        needed = {
            self.policy.version_for(self, g)
            for g in self._store.open.values()
            if (g.todo or g.parked) and not g.deferred
        }
        for v in sorted(needed - held - {None}):
            if v in self.published:
                self.load(max(self.engines, key=lambda e: (e.free, -e.id)).id, v)
