"""The scheduler core: the books, the mechanics and the invariants; every decision is a policy's.

Pure Python, no torch, no threads, no wall clock: `now` comes in with every call. The runtime (real
processes) and the simulator (cost models under a virtual clock) drive the same object:

    cmds = sched.poll(now)          # policy decides; the core books its decisions and returns them
    ... execute cmds, wait for something to happen ...
    sched.on_results(engine, trajectories, now) | on_trained(step, now) | on_published(version, now)
    | on_loaded(engine, version, now)

A policy (flow/policies/) reads the core's state and calls its actions: `open_group`, `dispatch`,
`abort`, `train`, `load`, `drop`. The core checks, at every train step, the invariants a policy
declares (staleness bound, one version per trajectory), and the ledger identity every poll.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Iterator

from tailrace.flow.commands import Abort, Command, DropWeights, Generate, LoadWeights, Sample, Train
from tailrace.flow.ledger import Ledger
from tailrace.flow.serde import prompt_to_dict
from tailrace.flow.store import GroupState, Store
from tailrace.types import Finish, Group, Prompt, Trajectory


class InvariantError(AssertionError):
    pass


@dataclass(frozen=True)
class FlowSpec:
    """The sizes every policy works with (validated by the run config)."""

    groups_per_round: int  # R: prompts per round (one published version per round in sync/pipe)
    samples_per_prompt: int  # K: samples trained per group
    groups_per_step: int  # U = B/K: groups per optimizer step
    total_steps: int  # optimizer steps in the run


@dataclass
class EngineState:
    id: int
    slots: int
    lookahead: int  # samples queued beyond the slots, so a freed slot never waits for the driver
    loaded: set[int] = field(default_factory=lambda: {0})
    loading: set[int] = field(default_factory=set)
    in_flight: dict[str, int] = field(default_factory=dict)  # sample id -> version

    @property
    def capacity(self) -> int:
        return self.slots + self.lookahead

    @property
    def free(self) -> int:
        return max(0, self.capacity - len(self.in_flight))

    def count(self, version: int) -> int:
        return sum(1 for v in self.in_flight.values() if v == version)


@dataclass
class Mark:
    """A time-stamped scheduler event for metrics and timelines (rollout windows, first dispatch)."""

    t: float
    kind: str
    data: dict


class Scheduler:
    def __init__(
        self, policy, prompts: Iterator[Prompt], engines: list[tuple[int, int]], spec: FlowSpec
    ) -> None:
        self.policy = policy
        self.spec = spec
        self.prompts = prompts
        self.prompts_taken = 0
        self.requeued: list[Prompt] = []  # prompts given back by a resume, served before new ones
        self.engines = [EngineState(i, slots, look) for i, (slots, look) in enumerate(engines)]
        self.store = Store()
        self.ledger = Ledger()
        self.trainer_version = 0  # weights the trainer holds now (published or about to be)
        self.published = {0}  # versions whose weights can be loaded into engines
        self.steps_issued = 0
        self.steps_done = 0
        self.next_group = 0
        self.samples: dict[str, Sample] = {}
        self.aborting: set[str] = set()  # aborts sent whose partials have not come back yet
        self.staleness: Counter = Counter()  # (trainer version - oldest token version) of trained samples
        self.done_version = 0  # trainer version after the last finished step (what a checkpoint holds)
        self._issued: dict[
            int, tuple[Counter, int | None]
        ] = {}  # step -> (its staleness, version it publishes)
        self.journal_seq = 0  # journal entries emitted so far (drained or not)
        self.now = 0.0
        self._out: list[Command] = []
        self._pending: dict[int, list[Sample]] = defaultdict(list)
        self.marks: list[Mark] = []
        self.journal: list[dict] = []  # write-ahead entries for resume (drained by the runtime)
        policy.attach(self)

    # ------------------------------------------------------------------ driving
    @property
    def done(self) -> bool:
        return self.steps_done >= self.spec.total_steps

    def stop(self) -> None:
        """Finish with the steps already issued (e.g. a time limit): no new steps, no new work."""
        self.spec = replace(self.spec, total_steps=self.steps_issued)

    def poll(self, now: float) -> list[Command]:
        self.now = now
        if not self.done:
            self.policy.decide(self)
        self._flush()
        self.ledger.check(self.store.in_store())
        for g in self.store.open.values():  # every dispatched sample is done, in flight or discarded
            if g.dispatched != len(g.done) + len(g.in_flight) + g.discarded:
                raise InvariantError(
                    f"group {g.id}: {g.dispatched} dispatched but {len(g.done)} done + "
                    f"{len(g.in_flight)} in flight + {g.discarded} discarded"
                )
        out, self._out = self._out, []
        return out

    def _log(self, entry: dict) -> None:
        self.journal.append(entry)
        self.journal_seq += 1

    def mark(self, kind: str, **data) -> None:
        self.marks.append(Mark(self.now, kind, data))

    # ------------------------------------------------------------------ events
    def on_results(self, engine: int, trajs: list[Trajectory], now: float) -> None:
        self.now = now
        eng = self.engines[engine]
        for t in trajs:
            sid = t.result.request_id
            if eng.in_flight.pop(sid, None) is None:
                raise InvariantError(f"engine {engine} returned sample {sid}, which it was not running")
            self.aborting.discard(sid)
            self._finish_sample(sid, t)

    def on_trained(self, step: int, now: float) -> None:
        self.now = now
        groups = self.store.trained(step)
        self.ledger.on_trained(sum(len(g.done) for g in groups))
        stale, publish = self._issued.pop(step)
        self.staleness.update(stale)
        if publish is not None:
            self.done_version = publish
        self.steps_done += 1
        self.mark("trained", step=step)

    def on_published(self, version: int, now: float) -> None:
        self.now = now
        self.published.add(version)
        self.mark("published", version=version)

    def on_loaded(self, engine: int, version: int, now: float) -> None:
        self.now = now
        e = self.engines[engine]
        e.loading.discard(version)
        e.loaded.add(version)
        self.mark("loaded", engine=engine, version=version)

    # ------------------------------------------------------------------ actions (called by policies)
    def open_group(self, version: int, wanted: int | None = None, keep: int | None = None) -> GroupState:
        requeued = bool(self.requeued)
        if requeued:
            prompt = self.requeued.pop(0)
        else:
            prompt = next(self.prompts)
            self.prompts_taken += 1
        k = self.spec.samples_per_prompt
        g = GroupState(
            id=self.next_group,
            prompt=prompt,
            version=version,
            wanted=wanted or k,
            keep=keep or k,
            opened=self.now,
        )
        self.next_group += 1
        self.store.add_group(g)
        self._log(
            {
                "kind": "open",
                "group": g.id,
                "version": version,
                "wanted": g.wanted,
                "keep": g.keep,
                "prompts_taken": self.prompts_taken,
                "requeued": requeued,
                "prompt": prompt_to_dict(prompt),
            }
        )
        return g

    def dispatch(
        self, engine: int, g: GroupState, n: int, version: int | None = None, queue_all: bool = False
    ) -> int:
        """Send up to n fresh samples of group g to an engine; returns how many went. `queue_all`
        ignores the engine's free capacity (its local queue takes the rest): sync hands a whole
        round over at once, so the engine's schedule does not depend on driver timing."""
        eng = self.engines[engine]
        v = g.version if version is None else version
        if v not in eng.loaded:
            raise InvariantError(
                f"dispatch of version {v} to engine {engine}, which holds {sorted(eng.loaded)}"
            )
        n = min(n, len(g.todo)) if queue_all else min(n, len(g.todo), eng.free)
        for _ in range(n):
            idx = g.todo.pop(0)
            self._send(
                eng, g, Sample(id=f"{g.id}.{idx}.0", group=g.id, index=idx, prompt=g.prompt, version=v)
            )
        if n and g.dispatched == n:
            self.mark("group_first_dispatch", group=g.id)
        return n

    def resume(self, engine: int, partial: Trajectory, version: int) -> None:
        """Re-dispatch an aborted partial under `version`; its tokens keep their own versions."""
        g = self.store.open[partial.group]
        attempt = int(partial.result.request_id.rsplit(".", 1)[1]) + 1
        r = partial.result
        s = Sample(
            id=f"{g.id}.{partial.sample_index}.{attempt}",
            group=g.id,
            index=partial.sample_index,
            prompt=g.prompt,
            version=version,
            resume_ids=r.token_ids,
            resume_logprobs=r.logprobs,
            resume_versions=r.versions,
        )
        self._send(self.engines[engine], g, s, fresh=False)

    def abort(self, engine: int, sample_ids: list[str], reason: str) -> None:
        ids = [sid for sid in sample_ids if sid not in self.aborting]
        if ids:
            self._flush()  # a Generate booked earlier in this poll must reach the engine before its Abort
            self.aborting.update(ids)
            self._out.append(Abort(engine, tuple(ids), reason))

    def discard_partial(self, partial: Trajectory, reason: str) -> None:
        """An aborted partial leaves for good: it is produced and discarded (e.g. early stop)."""
        self.ledger.on_produced()
        self.ledger.on_discarded(reason)
        self._log(
            {"kind": "discard", "group": partial.group, "index": partial.sample_index, "reason": reason}
        )
        g = self.store.open.get(partial.group)
        if g is not None:
            g.discarded += 1
            self._maybe_ready(g)

    def train(self, gids: list[int], publish: bool) -> int:
        step = self.steps_issued
        groups = self.store.take(gids, step)
        stale: Counter = Counter()
        for g in groups:
            for t in g.done:
                self._check_trainable(t)
                stale[self.trainer_version - t.oldest_version] += 1
        publish_v = self.trainer_version + 1 if publish else None
        self._issued[step] = (stale, publish_v)
        self._out.append(
            Train(
                step,
                tuple(Group(g.id, g.prompt.id, tuple(g.done)) for g in groups),
                self.trainer_version,
                publish_v,
            )
        )
        self.steps_issued += 1
        if publish_v is not None:
            self.trainer_version = publish_v
        self.mark("train_issued", step=step, groups=[g.id for g in groups])
        return step

    def load(self, engine: int, version: int) -> None:
        e = self.engines[engine]
        if version in e.loaded or version in e.loading:
            return
        if version not in self.published:
            raise InvariantError(f"load of unpublished version {version}")
        e.loading.add(version)
        self._out.append(LoadWeights(engine, version))

    def drop(self, engine: int, version: int) -> None:
        e = self.engines[engine]
        if version in e.loaded and e.count(version) == 0:
            e.loaded.discard(version)
            self._out.append(DropWeights(engine, version))

    # ------------------------------------------------------------------ queries
    @property
    def newest(self) -> int:
        return max(self.published)

    def open_groups(self) -> list[GroupState]:
        return list(self.store.open.values())

    def ready_ids(self) -> list[int]:
        return list(self.store.ready.keys())

    def in_flight(self, version: int | None = None) -> int:
        return sum(len(e.in_flight) if version is None else e.count(version) for e in self.engines)

    def live_versions(self) -> set[int]:
        """Versions some not-yet-trained sample depends on (open groups, or in flight)."""
        live = {g.version for g in self.store.open.values()}
        return live | {v for e in self.engines for v in e.in_flight.values()}

    # ------------------------------------------------------------------ internals
    def _send(self, eng: EngineState, g: GroupState, s: Sample, fresh: bool = True) -> None:
        if fresh:
            g.dispatched += 1
        g.in_flight.add(s.id)
        eng.in_flight[s.id] = s.version
        self.samples[s.id] = s
        self._pending[eng.id].append(s)

    def _flush(self) -> None:
        for engine, samples in self._pending.items():
            if samples:
                self._out.append(Generate(engine, tuple(samples)))
        self._pending.clear()

    def _finish_sample(self, sid: str, t: Trajectory) -> None:
        g = self.store.open[t.group]
        g.in_flight.discard(sid)
        self.samples.pop(sid, None)
        if t.result.finish == Finish.ABORTED:
            self.policy.on_aborted(self, t)  # resume or discard_partial; never silently lost
            return
        self.ledger.on_produced()
        g.done.append(t)
        self._log({"kind": "done", "group": g.id, "trajectory": t})
        self._maybe_ready(g)

    def _maybe_ready(self, g: GroupState) -> None:
        if g.id in self.store.open and not g.todo and not g.in_flight:
            kept, dropped = self.policy.select(g)
            for t, reason in dropped:
                self.ledger.on_discarded(reason)
            g.done = kept
            self.store.mark_ready(g.id, self.now)
            self.mark("group_ready", group=g.id, version=g.version)

    def _check_trainable(self, t: Trajectory) -> None:
        stale = self.trainer_version - t.oldest_version
        if stale > self.policy.max_staleness:
            raise InvariantError(
                f"group {t.group} sample {t.sample_index}: staleness {stale} > bound "
                f"{self.policy.max_staleness} of policy {self.policy.name}"
            )
        if not self.policy.mixed_versions and len(set(t.versions)) > 1:
            raise InvariantError(
                f"group {t.group} sample {t.sample_index} mixes versions {sorted(set(t.versions))}"
            )
