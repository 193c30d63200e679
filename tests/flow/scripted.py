"""A scripted cluster for scheduler tests: engines that emit one token per tick per running sample,
a trainer that takes a fixed number of ticks per step, weight loads that take a fixed time.
Lengths come from a function of (group, index), so tests choose any distribution; a sample that
reaches `max_len` is cut off there (finish = length)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Train
from tailrace.flow.keys import SampleKey
from tailrace.flow.scheduler import Outbox
from tailrace.records import JournalEntry, Mark
from tailrace.types import Finish, GenRequest, GenResult, Prompt, Scored, queue_by_priority

STEP_FIXED, STEP_ROW = 1.0, 0.25  # the scripted engines' step cost (seconds a step, a row)


def prompts():
    i = 0
    while True:
        yield Prompt(id=i, token_ids=(1, 2, 3), answer=str(i))
        i += 1


@dataclass
class Running:
    request: GenRequest
    key: SampleKey
    target: int
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn: int = 0  # multi-turn: tool calls answered before this request (its turn of the episode)


class ScriptedCluster:
    def __init__(
        self,
        sched,
        length: Callable[[int, int], int],
        slots: int,
        train_ticks: int = 5,
        load_ticks: int = 1,
        reward: Callable[[int, int], float] = lambda g, i: float(i % 2),
        max_len: int | None = None,
        pregen_len: int = 5,
        one_version: bool = False,
        turns: Callable[[int, int], list[int]] | None = None,
        tool_ticks: Callable[[int, int, int], int] = lambda g, i, k: 3,
        observation: tuple[int, ...] = (5, 5),
    ):
        """`one_version`: engines hold one version at a time (a load replaces it, and is refused while
        the engine has work), as `Capabilities.versions_at_once == 1` promises. `turns`: multi-turn
        samples, the tokens of each turn of (group, index) (each turn but the last ends in a tool call
        whose `observation` comes `tool_ticks(group, index, call)` ticks later); `length` is then unused."""
        self.turns, self.tool_ticks, self.observation = turns, tool_ticks, observation
        self.tools: list[tuple[int, str]] = []  # (tick the tool answers, request id)
        self.calls = 0
        self.turn_end: dict[tuple[int, int, int], int] = {}  # (group, index, turn) -> its last position
        self.s, self.slots, self.max_len, self.pregen_len = sched, slots, max_len, pregen_len
        self.one_version = one_version
        self.length = length if max_len is None else (lambda g, i: min(max_len, length(g, i)))
        self.train_ticks, self.load_ticks, self.reward = train_ticks, load_ticks, reward
        n = len(sched.engines)
        self.queue = [[] for _ in range(n)]
        self.running: list[list[Running]] = [[] for _ in range(n)]
        self.loaded = [{0} for _ in range(n)]
        self.loads: list[tuple[int, int, int]] = []  # (done tick, engine, version)
        self.trainer: list[Train] = []
        self.train_left = 0
        self.trained: list[Train] = []
        self.t = 0
        self.busy_slot_ticks = 0
        self.generated: list[SampleKey] = []  # every sample this cluster finished (not aborted)
        self.journal: list[JournalEntry] = []  # the journal and marks of every poll, in order
        self.marks: list[Mark] = []
        self.gone: set[int] = set()  # engines that left: commands to them are dropped
        self.miss: set[int] = set()  # engines whose next weight load misses (its weights were replaced)

    def execute(self, out: Outbox) -> None:
        self.journal.extend(out.journal)
        self.marks.extend(out.marks)
        for c in out.commands:
            if getattr(c, "engine", None) in self.gone:
                raise AssertionError(f"{type(c).__name__} sent to engine {c.engine}, which left")
            if isinstance(c, Generate):
                for req in c.requests:
                    assert req.version in self.loaded[c.engine], "dispatched a version the engine lacks"
                    own = req.id.rpartition("/")[2]  # (several policies: "name/id")
                    pregen = own.startswith("pregen.")  # the next round's prompts, generated in a bubble
                    ext = own.startswith("x.")  # an external agent's request (flow/external.py)
                    key = None if pregen or ext else SampleKey.parse(own)
                    if pregen or ext:
                        target = self.pregen_len
                    elif self.turns is not None:  # the turn ends where its first request was to end it
                        turn = self.s.calls_of(req.id)  # (a partial resumed mid-turn continues it)
                        target = self.turn_end.setdefault(
                            (key.group, key.index, turn),
                            len(req.resume_ids) + self.turns(key.group, key.index)[turn],
                        )
                    else:
                        target = self.length(key.group, key.index)
                    queue_by_priority(
                        self.queue[c.engine],
                        Running(
                            req,
                            key,
                            target,
                            list(req.resume_ids),
                            list(req.resume_versions),
                            self.s.calls_of(req.id) if self.turns is not None and key else 0,
                        ),  # fmt: skip
                        lambda r: r.request.priority,
                    )
            elif isinstance(c, Abort):
                out = []
                for pool in (self.queue[c.engine], self.running[c.engine]):
                    for r in [r for r in pool if r.request.id in c.request_ids]:
                        pool.remove(r)
                        out.append(self._result(r, Finish.ABORTED))
                self.s.on_results(c.engine, out, [], self.t)
            elif isinstance(c, Train):
                self.trainer.append(c)
            elif isinstance(c, LoadWeights):
                if self.one_version:
                    assert not self.queue[c.engine] and not self.running[c.engine], "loaded while busy"
                    self.loaded[c.engine] = set()
                self.loads.append((self.t + self.load_ticks, c.engine, c.version))
            elif isinstance(c, DropWeights):
                assert not any(r.request.version == c.version for r in self.running[c.engine]), (
                    "dropped in use"
                )
                self.loaded[c.engine].discard(c.version)

    def _result(self, r: Running, finish: Finish) -> GenResult:
        # routes as the engine keeps them, one byte a token here: the request's version's, but for the
        # tokens it resumed, which keep those it was given (`GenRequest.resume_routes`)
        fresh = bytes([r.request.version % 256] * len(r.tokens))
        routes = r.request.resume_routes + fresh[len(r.request.resume_routes) :]
        return GenResult(
            r.request.id,
            tuple(r.tokens),
            tuple(0.0 for _ in r.tokens),
            tuple(r.versions),
            finish,
            routes=routes,
        )

    def _finish(self, r: Running) -> Finish:
        return Finish.LENGTH if self.max_len is not None and r.target >= self.max_len else Finish.STOP

    def _score(self, r: Running) -> Scored:
        reward = self.reward(r.key.group, r.key.index)
        return Scored(r.request.id, reward, reward > 0)

    def tick(self) -> None:
        self.t += 1
        for done_t, rid in [x for x in self.tools if x[0] <= self.t]:
            self.tools.remove((done_t, rid))
            self.s.on_observation(rid, self.observation, self.t)
        for i, (done_t, e, v) in enumerate(list(self.loads)):
            if done_t <= self.t:
                self.loads.remove((done_t, e, v))
                if e in self.miss:  # newer versions took its weights' place before the engine read them
                    self.miss.discard(e)
                    self.s.on_load_missed(e, v, self.t)
                    continue
                self.loaded[e].add(v)
                self.s.on_loaded(e, v, self.t)
        for e in range(len(self.running)):
            run = self.running[e]
            while len(run) < self.slots and self.queue[e]:
                run.append(self.queue[e].pop(0))
            self.busy_slot_ticks += len(run)
            if run:  # a step's cost as an engine reports it: a fixed part and a part per row
                self.s.on_engine_steps(1, len(run), 0, STEP_FIXED + STEP_ROW * len(run))
            finished = []
            for r in run:
                r.tokens.append(7)
                r.versions.append(r.request.version)
                if len(r.tokens) >= r.target:
                    finished.append(r)
            for r in finished:
                run.remove(r)
            if finished:
                self.generated.extend(r.key for r in finished if r.key is not None)
                results = [self._result(r, self._finish(r)) for r in finished]
                calls = {r.request.id for r in finished if self._calls(r)}
                for r in finished:
                    if r.request.id in calls:
                        self.calls += 1
                        ticks = self.tool_ticks(r.key.group, r.key.index, r.turn)
                        self.tools.append((self.t + ticks, r.request.id))
                scores = [self._score(r) for r in finished if r.key is not None and r.request.id not in calls]
                self.s.on_results(e, results, scores, self.t, calls=calls)
        if self.trainer:
            self.train_left += 1
            if self.train_left >= self.train_ticks:
                c = self.trainer.pop(0)
                self.train_left = 0
                self.trained.append(c)
                self.s.on_trained(c.step, self.t)
                if c.publish is not None:
                    self.s.on_published(c.publish, self.t)

    def _calls(self, r: Running) -> bool:
        """The turn that finished ends in a tool call (multi-turn: every turn but the last)."""
        return (
            self.turns is not None
            and r.key is not None
            and r.turn < len(self.turns(r.key.group, r.key.index)) - 1
        )

    def lose_engine(self, e: int) -> int:
        """The engine's process dies: its queue and running samples vanish with it; its weights come
        back with its replacement (loads in flight are lost)."""
        self.queue[e], self.running[e] = [], []
        self.loads = [(t, eng, v) for t, eng, v in self.loads if eng != e]
        return self.s.on_engine_lost(e, self.t)

    def join_engine(self, lookahead: int = 2, started: bool = True) -> int:
        """A new engine with this cluster's slots joins the job holding no weights; returns its id.
        `started=False`: it is still starting, until `self.s.engine_started(id)`."""
        e = self.s.add_engine(self.slots, lookahead, started)
        assert e == len(self.queue), "engine ids are handed out in order"
        self.queue.append([])
        self.running.append([])
        self.loaded.append(set())
        return e

    def leave_engine(self, e: int) -> int:
        """Engine `e` leaves gracefully: the scheduler requeues its samples; the process stops (what it
        was running is never reported) and its loads in flight land nowhere."""
        n = self.s.remove_engine(e, self.t)
        self.gone.add(e)
        self.queue[e], self.running[e] = [], []
        self.loads = [(t, eng, v) for t, eng, v in self.loads if eng != e]
        return n

    def run(self, max_ticks: int = 100_000) -> None:
        while not self.s.done and self.t < max_ticks:
            self.execute(self.s.poll(self.t))
            self.tick()
        assert self.s.done, f"run did not finish in {max_ticks} ticks"
        self.execute(self.s.poll(self.t))


def random_lengths(seed: int) -> Callable[[int, int], int]:
    """Lognormal response lengths per (group, index), drawn once each, seeded."""
    import random

    rng, lengths = random.Random(seed), {}

    def length(g: int, i: int) -> int:
        return lengths.setdefault((g, i), max(1, int(rng.lognormvariate(1.8, 0.9))))

    return length


def every_third(g: int, i: int) -> float:
    """A reward that leaves some groups with signal and some without."""
    return float((g + i) % 3 == 0)


def run_to_crash(s, c: ScriptedCluster, crash_when: Callable) -> dict | None:
    """Drive `s` on `c`, checkpointing right after the poll that follows each finished step (executing
    that poll's aborts journals more), until `crash_when(s, c, ckpt)`; returns the last checkpoint, or
    None when there was none or the run finished first."""
    import json

    ckpt = None
    while not s.done and not crash_when(s, c, ckpt):
        c.execute(s.poll(c.t))
        before = s.steps_done
        c.tick()
        if s.steps_done > before:
            out = s.poll(c.t)
            ckpt = json.loads(json.dumps(s.state_dict()))
            c.execute(out)
    return None if s.done else ckpt


def restore(s2, ckpt: dict, journal: list) -> None:
    """Load `ckpt` into the fresh scheduler `s2` and replay the journal written after it (through JSON)."""
    import json

    from tailrace.records import journal_from_json

    s2.load_state_dict(ckpt)
    s2.replay(
        [journal_from_json(json.loads(json.dumps(e.to_json()))) for e in journal[ckpt["journal_seq"] :]]
    )
