"""The scheduler core: the books, the mechanics and the invariants; every decision is a policy's.

Pure Python, no torch, no threads, no wall clock: `now` comes in with every call. The runtime (real
processes), the simulator (cost models under a virtual clock) and the scripted test cluster drive
the same object through one surface:

    out = sched.poll(now)        # the policy decides; the core books its decisions
    ... execute out.commands, record out.journal and out.marks, wait for something to happen ...
    sched.on_results(engine, results, scores, now)   # engine results + the rewards of finished ones
    sched.on_trained(step, now) | on_published(version, now) | on_loaded(engine, version, now)
    | on_load_missed(engine, version, now)
    sched.on_observation(request_id, tokens, now)     # a tool answered a parked multi-turn sample

The scheduler owns a sample's whole lifecycle: it builds each engine request once (the run's
`SamplingParams`, a per-request seed), and turns results and their `Scored` rewards into
`Trajectory`s. Whoever drives it only turns text into rewards (`prompt_of` says which prompt a
request answers).

A policy (flow/policies/) reads the core's read-only view (`open`, `ready`, `in_training`,
`queued`, `engines`, `spec`, `newest`, `trainer_version`, ...) and calls its actions: `open_group`,
`dispatch`, `resume`, `abort`, `discard_partial`, `drop_group`, `defer_group`, `train`, `load`,
`drop`, `mark`. The
core checks, at every train step, the invariants a policy declares (staleness bound, one version
per trajectory), and the ledger identity every poll. Checkpoints and journal replay: see `state.py`;
engines joining, leaving, lost and lent: `engine_book.py`; an external agent's requests and groups:
`external.py` (mixins of `Scheduler`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Collection, Iterator, Mapping, Sequence

from tailrace.flow.commands import Abort, Command, DropWeights, Generate, LoadWeights, Train
from tailrace.flow.engine_book import EngineBook, EngineState, InvariantError
from tailrace.flow.external import ExternalBook, ExternalRequests, is_external
from tailrace.flow.keys import SampleKey, sample_seed
from tailrace.flow.ledger import Ledger
from tailrace.flow.replay import ReplayBuffer, ReplayOptions
from tailrace.flow.shaping import Plan, Shaping
from tailrace.flow.state import SchedulerState
from tailrace.flow.store import GroupState, Store
from tailrace.flow.turns import AtTool, Episode, continuation
from tailrace.records import Deferred, Discarded, Dropped, Finished, JournalEntry, Mark, Opened
from tailrace.types import (
    Capabilities,
    Finish,
    GenRequest,
    GenResult,
    Group,
    Prompt,
    SamplingParams,
    Scored,
    Trajectory,
)

# what the scheduler assumes of engines it is told nothing about: tailrace's own, without speculation
ANY_VERSIONS = Capabilities(
    abort_resume=True, versions_at_once=None, per_request_seed=True, speculative=False
)

PREGEN = "pregen."  # the id prefix of pre-generation requests (sample keys are group.index.attempt)


@dataclass(frozen=True)
class FlowSpec:
    """The sizes every policy works with (validated by the run config)."""

    groups_per_round: int  # R: prompts per round (one published version per round in sync/pipe)
    samples_per_prompt: int  # the group size: samples trained per group
    groups_per_step: int  # U = B / group size: groups per optimizer step
    total_steps: int  # optimizer steps in the run


@dataclass
class Outbox:
    """What one poll hands its driver: commands to execute in order, records to append."""

    commands: list[Command] = field(default_factory=list)
    journal: list[JournalEntry] = field(default_factory=list)  # the write-ahead log (journal.jsonl)
    marks: list[Mark] = field(default_factory=list)  # scheduler events (events.jsonl)


class Scheduler(SchedulerState, EngineBook, ExternalRequests):
    def __init__(
        self,
        policy,
        prompts: Iterator[Prompt],
        engines: list[tuple[int, int]],
        spec: FlowSpec,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        shaping: Shaping | None = None,
        capabilities: Capabilities = ANY_VERSIONS,
        replay: ReplayOptions | None = None,
    ) -> None:
        """`engines`: (slots, lookahead) per engine. `sampling`: the params of every request (a
        policy may pass others to `dispatch`); each request gets its own seed from `seed` and its id.
        `shaping`: how many candidates a prompt gets and which ones its group trains on (none: all).
        `capabilities`: what the engines can do; a policy that needs more is refused here. `replay`:
        the store's replay buffer (flow/replay.py; none: every group is trained once)."""
        if policy.refusal(capabilities):
            raise ValueError(policy.refusal(capabilities))
        self.policy = policy
        self.capabilities = capabilities
        self.shaping = shaping or Shaping()
        self.shaping.set_overlap(policy.max_staleness > 0)
        self.spec = spec
        self._prompts = prompts
        self._sampling = sampling or SamplingParams()
        self._seed = seed
        self.prompts_taken = 0
        self._requeued: list[Prompt] = []  # prompts given back by a resume, served before new ones
        self._upcoming: list[tuple[Prompt, Plan]] = []  # taken from the stream and planned, not opened
        self._cut: set[str] = set()  # requests shaping aborted: their partials are discarded
        self._spent: set[str] = set()  # requests aborted because the policy is done (`_wind_down`)
        self.shaping_tokens = 0  # tokens of samples discarded by shaping (what redundancy cost)
        self._generated: list[int] = []  # lengths produced since `take_generated`, before selection
        self._by_id: dict[int, EngineState] = {
            i: EngineState(i, slots, look, versions_at_once=capabilities.versions_at_once)
            for i, (slots, look) in enumerate(engines)
        }
        self.engines: tuple[EngineState, ...] = tuple(self._by_id.values())  # the live ones, by id
        self.departed: set[int] = set()  # engines that left (`remove_engine`): never given work again
        self.lent: set[int] = set()  # engines serving another policy for now (`lend_engine`)
        self.starting: set[int] = set()  # joined, not yet up (`add_engine(started=False)`): no orders yet
        self._store = Store()
        self.replay_buffer = ReplayBuffer(replay) if replay is not None and replay.ratio > 0 else None
        self.ledger = Ledger()
        self.trainer_version = 0  # weights the trainer holds now (published or about to be)
        self.published = {0}  # versions whose weights can be loaded into engines
        self.steps_issued = 0
        self.steps_done = 0
        self.groups_opened = 0  # group ids handed out (the next group's id)
        self.groups_withdrawn = 0  # of them, opened under weights a crash lost: a resume un-opened them
        self.groups_done: Counter = Counter()  # complete groups; with all rewards equal; deferred by shaping
        self.groups_dropped: Counter = Counter()  # reason -> complete groups that left untrained
        self._aborting: set[str] = set()  # aborts sent whose partials have not come back yet
        self.staleness: Counter = Counter()  # (trainer version - oldest token version) of trained samples
        self.done_version = 0  # trainer version after the last finished step (what a checkpoint holds)
        self._issued: dict[
            int, tuple[Counter, int | None]
        ] = {}  # step -> (its staleness, version it publishes)
        self.journal_seq = 0  # journal entries emitted so far (handed out or not)
        self.now = 0.0
        self._out = Outbox()
        self._pending: dict[int, list[GenRequest]] = defaultdict(list)
        self._pregen: dict[str, tuple[int, Prompt]] = {}  # pre-generation in flight: id -> (engine, prompt)
        self._pregen_done: list[tuple[Prompt, GenResult]] = []  # finished or aborted, for `take_pregen`
        self._pregen_n = 0
        self._at_tool: dict[str, AtTool] = {}  # multi-turn samples parked while their tool runs, by request
        self._episodes: dict[tuple[int, int], Episode] = {}  # (group, index) -> its tool calls so far
        self._seeds: dict[str, int | None] = {}  # a continuation's request id -> its episode's seed
        self.external = ExternalBook()  # an external agent's requests (flow/external.py)
        policy.attach(self)

    # ------------------------------------------------------------------ driving
    @property
    def done(self) -> bool:
        return self.steps_done >= self.spec.total_steps

    def stop(self) -> None:
        """Finish with the steps already issued (e.g. a time limit): no new steps, no new work."""
        self.spec = replace(self.spec, total_steps=self.steps_issued)

    def poll(self, now: float) -> Outbox:
        self.now = now
        if not self.done:
            self._provision()
            self.policy.decide(self)
            self._dispatch_external()
        else:
            self._wind_down()
        self._flush()
        self.ledger.check(self._store.in_store())
        for g in self._store.open.values():  # every dispatched sample is done, in flight, parked or discarded
            if g.dispatched != len(g.done) + len(g.in_flight) + len(g.parked) + g.discarded:
                raise InvariantError(
                    f"group {g.id}: {g.dispatched} dispatched but {len(g.done)} done + "
                    f"{len(g.in_flight)} in flight + {len(g.parked)} parked + {g.discarded} discarded"
                )
        out, self._out = self._out, Outbox()
        return out

    def salvage(self) -> Outbox:
        """After a poll that raised bad input (a user's store filter): what it had booked, its journal
        entries and marks (facts, each of them: trajectories finished, groups opened or dropped), for
        the run directory to keep; its commands are never sent (a group opened without them is
        dispatched again on resume)."""
        out, self._out = self._out, Outbox()
        return replace(out, commands=[])

    def in_store(self) -> int:
        """Trajectories in the store (open, ready or in training), recounted from the data."""
        return self._store.in_store()

    def ledger_record(self) -> dict:
        """The ledger's counts, `in_store`, groups complete, complete with all rewards equal
        (zero_signal) and dropped untrained by reason, and the tokens of samples shaping discarded
        (a step record's `ledger`; cumulative)."""
        groups = {**self.groups_done, "dropped": dict(self.groups_dropped)}
        replay = {"replay": self.replay_buffer.record()} if self.replay_buffer else {}
        return {
            **self.ledger.state_dict(), "in_store": self.in_store(), "groups": groups,
            "shaping_tokens": self.shaping_tokens, **replay,
        }  # fmt: skip

    def take_generated(self) -> list[int]:
        """Lengths of the samples produced since the last call (finished, or cut by shaping): what the
        engines generated, before shaping selected what is trained."""
        out, self._generated = self._generated, []
        return out

    def take_pregen(self) -> list[tuple[Prompt, GenResult]]:
        """Pre-generated responses (finished, or aborted partway) since the last call, with their
        prompts: the history drafters' material for the round that opens those prompts."""
        out, self._pregen_done = self._pregen_done, []
        return out

    @staticmethod
    def is_pregen(request_id: str) -> bool:
        """The request is a pre-generation (`pregen`), not a sample of any group."""
        return request_id.startswith(PREGEN)

    def pregen_in_flight(self, engine: int | None = None) -> int:
        """Pre-generation requests in flight (on `engine`, or on all)."""
        return sum(1 for e, _ in self._pregen.values() if engine is None or e == engine)

    def prompt_of(self, request_id: str) -> Prompt:
        """The prompt an in-flight request answers (what a driver needs to score its result)."""
        g = self._store.open.get(SampleKey.parse(request_id).group)
        if g is None or SampleKey.parse(request_id) not in g.in_flight:
            raise InvariantError(f"request {request_id} is not in flight")
        return g.prompt

    # ------------------------------------------------------------------ events
    def on_results(
        self,
        engine: int,
        results: Sequence[GenResult],
        scores: Sequence[Scored],
        now: float,
        calls: Collection[str] = (),
    ) -> None:
        """Finished or aborted requests of `engine`; `scores` holds one `Scored` per result that is
        not aborted (an aborted partial has no reward) nor in `calls`: the ids of results whose turn
        ended in a tool call (multi-turn), which park, their engine slots free, until `on_observation`."""
        self.now = now
        if engine in self.departed:  # crossed its leave: its samples were requeued already
            return
        eng = self._by_id[engine]
        scored = {s.request_id: s for s in scores}
        for r in results:
            rid = r.request_id
            if self.is_pregen(rid):  # a next-round prompt generated in a bubble: drafts, never trained
                self._aborting.discard(rid)
                if rid in self._pregen:  # (an abort that crossed its finish brings nothing more)
                    self._pregen_done.append((self._pregen.pop(rid)[1], r))
                continue
            version = eng.in_flight.pop(rid, None)
            if version is None:
                raise InvariantError(f"engine {engine} returned request {rid}, which it was not running")
            self._aborting.discard(rid)
            if is_external(rid):  # an agent's: back to it, kept for a group
                self.external.on_result(r, version, now)
                continue
            key = SampleKey.parse(rid)
            g = self._store.open[key.group]
            seed = self._seeds.pop(rid, None)
            if rid in calls and r.finish != Finish.ABORTED:  # parks; it stays the group's, in flight
                seed = sample_seed(self._seed, rid) if seed is None else seed
                self._at_tool[rid] = AtTool(engine, version, seed, r, now)
                continue
            g.in_flight.discard(key)
            if r.finish == Finish.ABORTED:
                partial = self._trajectory(g, key, r, version, None)
                if rid in self._cut:
                    self._cut.discard(rid)
                    self.shaping_tokens += partial.length
                    self._generated.append(partial.length)
                    self.discard_partial(partial, "shaping")
                elif rid in self._spent:
                    self._spent.discard(rid)
                    self.discard_partial(partial, "done")
                else:
                    self.policy.on_aborted(self, partial)
                continue  # resumed or discarded; never silently lost
            self._cut.discard(rid)  # finished before its abort arrived: selection decides
            s = scored.get(rid)
            if s is None:
                raise InvariantError(f"request {rid} finished ({r.finish.value}) without a score")
            t = self._trajectory(g, key, r, version, s)
            self._generated.append(t.length)
            self._episodes.pop((key.group, key.index), None)
            self.ledger.on_produced()
            g.done.append(t)
            self._log(Finished(t))
            self._maybe_ready(g)

    def on_observation(self, request_id: str, token_ids: Sequence[int], now: float) -> None:
        """The tool answered the call that parked `request_id`: the sample continues, with the whole
        context so far, on the engine its turn ran on (or another holding its version). An observation
        longer than the response budget left is cut to leave the continuation one token."""
        self.now = now
        at = self._at_tool.pop(request_id, None)
        if at is None:
            raise InvariantError(f"observation for request {request_id}, which is not waiting on a tool")
        key = SampleKey.parse(request_id)
        g = self._store.open[key.group]
        g.in_flight.discard(key)
        room = self._sampling.max_new_tokens - len(at.turn.token_ids) - 1
        if room < 0:  # the engine would finish it without a step, and so without a report
            raise InvariantError(
                f"{request_id} parked for a tool on the last token of its budget; score it instead"
            )
        obs = tuple(token_ids)[:room]
        ep = self._episodes.setdefault((key.group, key.index), Episode())
        start = len(at.turn.token_ids)
        ep.calls += 1
        if obs:
            ep.observed.append((start, start + len(obs)))
        ep.tool_s += now - at.since
        # under the version its mode resumes samples with (partial: the newest; its tokens keep theirs),
        # else its own
        version = self.policy.version_for(self, g)
        version = at.version if version is None else version
        holding = [e for e in self.engines if version in e.loaded]
        if not holding and version != at.version:
            version = at.version
            holding = [e for e in self.engines if version in e.loaded]
        if not holding:  # its engines left: the sample starts over from its prompt, as a lost one does
            self._episodes.pop((key.group, key.index), None)
            self._requeue_sample(g, key)
            self.mark("continuation_requeued", request=request_id, version=at.version)
            return
        eng = self._by_id[at.engine] if self._by_id[at.engine] in holding else holding[0]
        nxt = key.next_attempt()
        rid = str(nxt)
        self._seeds[rid] = at.seed
        params = replace(self._sampling, seed=at.seed)
        g.in_flight.add(nxt)
        eng.in_flight[rid] = version
        self._pending[eng.id].append(continuation(rid, g.prompt.token_ids, params, version, at.turn, obs))

    def calls_of(self, request_id: str) -> int:
        """Tool calls answered so far in the episode of an in-flight request (0: its first turn)."""
        ep = self._episodes.get((SampleKey.parse(request_id).group, SampleKey.parse(request_id).index))
        return ep.calls if ep else 0

    @property
    def at_tool(self) -> int:
        """Samples parked while their tools run (they hold no engine slot)."""
        return len(self._at_tool)

    def on_trained(self, step: int, now: float) -> None:
        self.now = now
        groups = self._store.trained(step)
        self.ledger.on_trained(sum(len(g.done) for g in groups))
        if self.replay_buffer is not None:
            self.replay_buffer.on_trained(step, [(g.prompt, g.id, g.done) for g in groups])
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
        if engine in self.departed:  # a load that landed after its engine left
            return
        e = self._by_id[engine]
        e.loading.discard(version)
        e.loaded.add(version)
        self.mark("loaded", engine=engine, version=version)

    def on_load_missed(self, engine: int, version: int, now: float) -> None:
        """`engine` could not load `version`: newer versions had replaced its weights before it read
        them (an engine that joined reads them over the wire, and may be slow to). It holds what it held
        (on a one-version engine: nothing in the books); the next poll asks it for what it needs now
        (`_provision`: the newest where it holds nothing)."""
        self.now = now
        if engine in self.departed:
            return
        self._by_id[engine].loading.discard(version)
        self.mark("load_missed", engine=engine, version=version)

    def on_engine_steps(self, steps: int, decode_tokens: int, prefill_tokens: int, busy_s: float) -> None:
        """An engine's step counts and busy seconds since its last report (what shaping may size its
        redundancy from; nothing else of the schedule depends on time)."""
        slots = sum(e.slots for e in self.engines)
        self.shaping.observe_steps(steps, decode_tokens, prefill_tokens, busy_s, slots, len(self.engines))

    def on_train_step(self, lengths: Sequence[int], busy_s: float) -> None:
        """An optimizer step's trained response lengths and busy seconds (what shaping may price
        training from)."""
        self.shaping.observe_train(len(lengths), sum(lengths), sum(n * n for n in lengths), busy_s)

    # ------------------------------------------------------------------ the policies' view
    @property
    def open(self) -> Mapping[int, GroupState]:
        """Groups still generating, by id."""
        return MappingProxyType(self._store.open)

    @property
    def ready(self) -> Mapping[int, GroupState]:
        """Complete groups waiting for the trainer, in completion order."""
        return MappingProxyType(self._store.ready)

    def in_training(self, gid: int) -> bool:
        return self._store.in_training(gid)

    def queued(self) -> Iterator[GroupState]:
        """Groups not yet handed to a train step (open, then ready)."""
        return self._store.queued()

    @property
    def newest(self) -> int:
        return max(self.published)

    def in_flight(self, version: int | None = None) -> int:
        """Samples in flight (of `version`); an external agent's requests are not the policy's to wait
        for (each still holds its version on its engine against a drop)."""
        return sum(
            1
            for e in self.engines
            for rid, v in e.in_flight.items()
            if version in (None, v) and not is_external(rid)
        )

    def live_versions(self) -> set[int]:
        """Versions some not-yet-trained sample depends on (open groups, or in flight)."""
        live = {g.version for g in self._store.open.values()}
        return live | {v for e in self.engines for v in e.in_flight.values()}

    # ------------------------------------------------------------------ actions (called by policies)
    def open_group(self, version: int) -> GroupState:
        requeued = bool(self._requeued)
        prompt, plan = self._next_prompt()
        g = GroupState(
            self.groups_opened, prompt, version, self.spec.samples_per_prompt, opened=self.now,
            candidates=plan.candidates, early_stop=plan.early_stop, own=plan.own,
        )  # fmt: skip
        self.groups_opened += 1
        self._store.add_group(g)
        self._log(
            Opened(g.id, version, self.prompts_taken, requeued and not plan.own, prompt, g.candidates,
                   g.early_stop, plan.own)
        )  # fmt: skip
        return g

    def dispatch(
        self,
        engine: int,
        g: GroupState,
        n: int,
        version: int | None = None,
        queue_all: bool = False,
        params: SamplingParams | None = None,
    ) -> int:
        """Send up to n fresh samples of group g to an engine; returns how many went. `queue_all`
        ignores the engine's free capacity (its local queue takes the rest): sync hands a whole
        round over at once, so the engine's schedule does not depend on driver timing. `params`
        replaces the run's sampling params for these samples (their seeds stay per request)."""
        eng = self.engine(engine)
        v = g.version if version is None else version
        if v not in eng.loaded:
            raise InvariantError(
                f"dispatch of version {v} to engine {engine}, which holds {sorted(eng.loaded)}"
            )
        n = min(n, len(g.todo)) if queue_all else min(n, len(g.todo), eng.free)
        for _ in range(n):
            g.dispatched += 1
            self._send(eng, g, SampleKey(g.id, g.todo.pop(0)), v, params)
        if n and g.dispatched == n:
            self.mark("group_first_dispatch", group=g.id)
        return n

    def resume(self, engine: int, partial: Trajectory, version: int) -> None:
        """Re-dispatch an aborted (or parked) partial under `version`; its tokens keep their versions."""
        g = self._store.open[partial.group]
        if partial in g.parked:
            g.parked.remove(partial)
        key = SampleKey.parse(partial.result.request_id).next_attempt()
        self._send(self.engine(engine), g, key, version, None, partial.result)

    def abort(self, engine: int, request_ids: list[str], reason: str) -> None:
        ids = [rid for rid in request_ids if rid not in self._aborting]
        if ids:
            self._flush()  # a Generate booked earlier in this poll must reach the engine before its Abort
            self._aborting.update(ids)
            self._out.commands.append(Abort(engine, tuple(ids), reason))

    def _wind_down(self) -> None:
        """Done (its steps trained, or stopped): the samples it still has generating (a streaming mode
        works ahead; a policy that left mid-round) are aborted, their partials discarded ("done"), so a
        policy that finishes before others sharing the engines frees its slots at once."""
        for e in self.engines:
            ids = sorted(
                rid for rid in e.in_flight
                if rid not in self._aborting and rid not in self._at_tool and not is_external(rid)
            )  # fmt: skip
            if ids:
                self._spent.update(ids)
                self.abort(e.id, ids, "done")

    def park(self, partial: Trajectory) -> None:
        """Keep an aborted partial in its group, to `resume` later (e.g. under the next weights). A
        checkpoint does not keep it: a resumed run generates the sample again."""
        self._store.open[partial.group].parked.append(partial)

    def peek(self, n: int) -> list[Prompt]:
        """The next n prompts `open_group` will take (requeued ones, then the planned window, planning
        more windows from the stream as needed): what the next round will generate."""
        while len(self._upcoming) < n:
            window = [next(self._prompts) for _ in range(self.shaping.window)]
            self.prompts_taken += len(window)
            self._upcoming += list(zip(window, self.shaping.plan(window, self.spec.samples_per_prompt)))
        return (self._requeued + [p for p, _ in self._upcoming])[:n]

    def pregen(self, engine: int, prompts: Sequence[Prompt], version: int) -> None:
        """Generate one response to each prompt on `engine` under `version`, outside every group (they
        are drafts for a later round: `take_pregen`); the engine queues them like any request."""
        if version not in self.engine(engine).loaded:
            raise InvariantError(f"pre-generation under version {version} on engine {engine}, which lacks it")
        for p in prompts:
            rid = f"{PREGEN}{self._pregen_n}"
            self._pregen_n += 1
            self._pregen[rid] = (engine, p)
            params = replace(self._sampling, seed=sample_seed(self._seed, rid))
            self._pending[engine].append(GenRequest(rid, p.token_ids, params, version))
        self.mark("pregen", prompts=[p.id for p in prompts], version=version)

    def abort_pregen(self) -> None:
        """Abort the pre-generation still running (the round it was for starts now)."""
        if not self._pregen.keys() - self._aborting:
            return
        self.mark("pregen_aborted", requests=len(self._pregen.keys() - self._aborting))
        for e in self.engines:
            self.abort(e.id, sorted(rid for rid, (eng, _) in self._pregen.items() if eng == e.id), "pregen")

    def discard_partial(self, partial: Trajectory, reason: str) -> None:
        """An aborted partial leaves for good: it is produced and discarded (e.g. early stop)."""
        self.ledger.on_produced()
        self.ledger.on_discarded(reason)
        self._log(Discarded(partial.group, partial.sample_index, reason))
        g = self._store.open.get(partial.group)
        if g is not None:
            g.discarded += 1
            self._maybe_ready(g)

    def drop_group(self, gid: int, reason: str) -> None:
        """A ready group leaves untrained (e.g. zero-signal, replaced by a fresh prompt); its samples
        are discarded with `reason`."""
        g = self._store.drop(gid)
        self.ledger.on_discarded(reason, len(g.done))
        self.groups_dropped[reason] += 1
        self._log(Dropped(gid, reason))
        self.mark("group_dropped", group=gid, reason=reason)

    def defer_group(self, gid: int) -> None:
        """Shaping gives an open or ready group up (tailbatch: it missed its round's cut): its prompt
        waits in shaping's queue for a later round; its candidates not yet dispatched are never
        dispatched, those in flight are aborted, and its samples are discarded (reason `shaping`)
        once none is in flight."""
        g = self._store.open.get(gid) or self._store.ready.get(gid)
        if g is None or g.deferred:
            raise InvariantError(f"defer of group {gid}, which is neither open nor ready (or deferred)")
        if gid in self._store.ready:  # complete already: back to open, to leave like the others
            del self._store.ready[gid]
            self._store.add_group(g)
        g.deferred = True
        self.groups_done["deferred"] += 1
        self.shaping.defer(g.prompt)
        self._log(Deferred(gid))
        self.mark("group_deferred", group=gid, prompt=g.prompt.id)
        self._maybe_ready(g)

    def train(self, gids: list[int], publish: bool) -> int:
        step = self.steps_issued
        groups = self._store.take(gids, step)
        stale: Counter = Counter()
        for g in groups:
            for t in g.done:
                self._check_trainable(t)
                stale[self.trainer_version - t.oldest_version] += 1
        publish_v = self.trainer_version + 1 if publish else None
        self._issued[step] = (stale, publish_v)
        replays = (
            []
            if self.replay_buffer is None
            else self.replay_buffer.pick(step, len(groups), self.trainer_version)
        )
        batch = tuple(Group(g.id, g.prompt.id, tuple(g.done)) for g in groups) + tuple(replays)
        self._out.commands.append(Train(step, batch, self.trainer_version, publish_v))
        self.steps_issued += 1
        if publish_v is not None:
            self.trainer_version = publish_v
        samples = [[t.sample_index for t in g.done] for g in groups]  # shaping may have trained a subset
        more = {"replayed": [g.id for g in replays]} if replays else {}
        self.mark("train_issued", step=step, groups=[g.id for g in groups], samples=samples, **more)
        return step

    def load(self, engine: int, version: int) -> None:
        """Ask `engine` to load `version`. An engine holding one version at a time replaces the one it
        holds, so it is asked only once it is drained (no request in flight, no load under way; until
        then this does nothing and the policy asks again), and holds nothing until the load lands."""
        e = self.engine(engine)
        if version in e.loaded or version in e.loading:
            return
        if version not in self.published:
            raise InvariantError(f"load of unpublished version {version}")
        if e.versions_at_once == 1:
            if e.in_flight or e.loading or self.pregen_in_flight(engine):
                return
            e.loaded.clear()
        e.loading.add(version)
        self._out.commands.append(LoadWeights(engine, version))

    def drop(self, engine: int, version: int) -> None:
        e = self.engine(engine)
        if version in e.loaded and e.count(version) == 0:
            e.loaded.discard(version)
            self._out.commands.append(DropWeights(engine, version))

    def mark(self, kind: str, **data) -> None:
        self._out.marks.append(Mark(self.now, kind, data))

    # ------------------------------------------------------------------ internals
    def _next_prompt(self) -> tuple[Prompt, Plan]:
        """The next prompt to open and its shaping plan: one of shaping's own (a tail round's) first,
        then a requeued prompt (planned as the group size), else the next of the planned window,
        taking a fresh window from the stream."""
        own = self.shaping.next_prompt(self.spec.samples_per_prompt)
        if own is not None:
            return own
        if self._requeued:
            return self._requeued.pop(0), Plan(self.spec.samples_per_prompt)
        if not self._upcoming:
            window = [next(self._prompts) for _ in range(self.shaping.window)]
            self.prompts_taken += len(window)
            self._upcoming = list(zip(window, self.shaping.plan(window, self.spec.samples_per_prompt)))
        return self._upcoming.pop(0)

    def _log(self, entry: JournalEntry) -> None:
        self._out.journal.append(entry)
        self.journal_seq += 1

    def _send(
        self, eng: EngineState, g: GroupState, key: SampleKey, version: int, params, partial=None
    ) -> None:
        rid = str(key)
        p = replace(params or self._sampling, seed=sample_seed(self._seed, rid))
        if partial is None:
            req = GenRequest(rid, g.prompt.token_ids, p, version)
        else:
            req = GenRequest(rid, g.prompt.token_ids, p, version, partial.token_ids, partial.logprobs,
                             partial.versions, resume_routes=partial.routes)  # fmt: skip
        g.in_flight.add(key)
        eng.in_flight[rid] = version
        self._pending[eng.id].append(req)

    def _flush(self) -> None:
        for engine, reqs in self._pending.items():
            if reqs:
                self._out.commands.append(Generate(engine, tuple(reqs)))
        self._pending.clear()

    def _trajectory(
        self, g: GroupState, key: SampleKey, r: GenResult, version: int, s: Scored | None
    ) -> Trajectory:
        ep = self._episodes.get((key.group, key.index)) or Episode()
        return Trajectory(
            group=g.id, sample_index=key.index, prompt_id=g.prompt.id, prompt_ids=g.prompt.token_ids,
            result=r, reward=s.reward if s else 0.0, correct=s.correct if s else False,
            dispatch_version=version, observed=tuple(ep.observed), tool_s=ep.tool_s,
        )  # fmt: skip

    def _maybe_ready(self, g: GroupState, cut: bool = True) -> None:
        """Hand a complete group to the store's ready queue, after shaping's selection; first, when
        shaping has what it needs or gave the group up (`cut`), its other candidates stop: never
        dispatched, or aborted. A deferred group, once drained, leaves with its samples discarded."""
        if g.id not in self._store.open:
            return
        if cut and (g.todo or g.in_flight) and (g.deferred or self.shaping.enough(g)):
            g.todo.clear()  # shaping has what it needs: the other candidates stop
            ids = {str(k) for k in g.in_flight} - self._cut
            self._cut |= ids
            for e in self.engines:
                self.abort(e.id, sorted(ids & e.in_flight.keys()), "shaping")
        if g.deferred and not g.todo and not g.in_flight:
            self._store.remove_open(g.id)
            if g.done:
                self.ledger.on_discarded("shaping", len(g.done))
            self.shaping_tokens += sum(t.length for t in g.done)
            return
        if not g.todo and not g.in_flight and not g.parked:
            self.shaping.observe(g)
            kept, rest = self.shaping.select(g)
            if rest:
                self.ledger.on_discarded("shaping", len(rest))
            self.shaping_tokens += sum(t.length for t in rest)
            g.done = kept
            self.groups_done["complete"] += 1
            self.groups_done["zero_signal"] += g.zero_signal
            self._store.mark_ready(g.id, self.now)
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
