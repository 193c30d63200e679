"""`SimEngine`: one rollout engine (a data-parallel replica of `engine_gpus` devices) as a state
machine under a virtual clock. No SimPy here: the cluster asks `plan(now)` when the next thing
happens, waits, and calls `fire()`.

It behaves like the real engine worker: continuous batching over `slots`, a local queue for the
lookahead the scheduler keeps topped up, commands (Generate, Abort, LoadWeights, DropWeights)
applied between steps — at the next step boundary when the engine is decoding — and one forward per
policy version present in the batch. Between two boundaries the batch is constant and time advances
by a `Segment` in closed form; a step is the unit of progress (a command never splits one).

Time is kept as (t_b, step): the engine sits at a step boundary at time t_b with `step` decode steps
done since it started; decode step k after t_b ends at t_b + segment.time(k + 1). Prefill of newly
admitted requests and weight loads are blocks that move t_b forward.

KV memory (`kv_tokens`, None = unbounded): every running sequence holds its prompt and the tokens it
has, and each loaded version beyond the first displaces its weights' worth of cache. A request is
admitted only if the next step still fits everyone; when growing contexts fill the cache the most
recently admitted sequence is preempted — requeued at the front, its tokens kept, and prefilled again
with them when readmitted (vLLM's recompute preemption). A boundary is planned where the cache fills.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights
from tailrace.flow.keys import SampleKey
from tailrace.sim.costs import CostModel
from tailrace.sim.lengths import LengthModel
from tailrace.sim.runs import Runs
from tailrace.sim.segment import Segment
from tailrace.types import Finish, GenRequest, GenResult, queue_by_priority

TOKEN = 1  # every simulated token has this id; only counts matter


@dataclass(frozen=True)
class Block:
    """Stop decoding until `until` (colocated training holds the devices)."""

    until: float


@dataclass(frozen=True)
class Stall:
    """Stop decoding for `seconds` from the next step boundary (the host core is taken by other work:
    the driver handling this engine's report; see `Hardware.driver_report_s`)."""

    seconds: float


@dataclass(frozen=True)
class CoRun:
    """From the next step on, decode steps take `factor` times their cost (a trainer computing on the
    same host slows them; 1.0 when it stops). See `Hardware.corun_slowdown`."""

    factor: float


@dataclass
class Job:
    request: GenRequest
    prompt_len: int
    base: int  # tokens carried in from an aborted partial
    target: int  # total response tokens when it finishes
    truncated: bool
    submitted: float
    uid: int
    start: int = -1  # engine step at which it joined the decode batch
    first_token: float = 0.0
    done: int = 0  # tokens generated before it was preempted (recomputed by its next prefill)
    order: int = 0  # admission order: the latest admitted is preempted first

    def tokens(self, step: int) -> int:
        return self.base + self.done + (step - self.start if self.start >= 0 else 0)


@dataclass
class Report:
    """What one `fire()` produced: results now, weight loads finished at their own time."""

    results: list[GenResult] = field(default_factory=list)
    loaded: list[tuple[int, float]] = field(default_factory=list)  # (version, time it is usable)
    steps: int = 0  # decode steps advanced, their tokens and busy seconds (what an engine reports)
    decode_tokens: int = 0
    busy_s: float = 0.0


@dataclass
class Span:
    phase: str  # generate | sync | wait | train | checkpoint
    t0: float
    t1: float
    version: int | None = None


class SimEngine:
    def __init__(
        self,
        eid: int,
        slots: int,
        cost: CostModel,
        lengths: LengthModel,
        start_versions: Iterable[int] = (0,),
        kv_tokens: int | None = None,
        spec: tuple[float, int, float] | None = None,
    ) -> None:
        """`lengths` says how long each request runs, by (prompt id, sample index): the driver sets
        `describe` (request id -> that pair) from its scheduler; by default the request id is read
        as a sample key with the group standing for the prompt. `start_versions`: the weights it holds
        at the start (several policies sharing the engine: each policy's version 0, flow/multi.py)."""
        if slots < 1:
            raise ValueError(f"engine {eid}: slots={slots} must be at least 1")
        self.id, self.slots, self.cost, self.lengths = eid, slots, cost, lengths
        self.kv_tokens = kv_tokens
        self.spec = spec  # (alpha, gamma, min_speedup): speculative decoding where it pays, else None
        self.spec_on = False  # the current segment speculates
        self.spec_busy = 0.0  # decode time spent speculating
        self.describe: Callable[[str], tuple[int, int]] = _group_and_index
        self.loaded = set(start_versions)
        self.queue: deque[Job] = deque()
        self.running: dict[str, Job] = {}
        self.heap: list[tuple[int, int, str]] = []  # (finish step, uid, request id)
        self.inbox: list = []
        self.received: set[str] = set()  # every request id this engine was sent
        self.t_b = 0.0
        self.step = 0
        self.count: dict[int, int] = {}  # version -> running sequences
        self.ctx: dict[int, int] = {}  # version -> their total context at t_b
        self.segment = Segment(0.0, ())
        self.slowdown = 1.0  # see CoRun
        self._plan: tuple[float, int] | None = None
        self._uid = 0
        # accounting (cumulative)
        self.slot_time = 0.0  # sum over steps of active sequences x step duration
        self.busy_time = 0.0
        self.stalled = 0.0  # time lost to Stall commands
        self.gen_tokens = 0
        self.preemptions = 0
        self.recomputed_tokens = 0  # tokens prefilled again after a preemption
        self._order = 0
        self.spans: list[Span] = []

    # ------------------------------------------------------------------ inputs
    def post(self, cmd) -> None:
        """Queue a command; it takes effect at the engine's next boundary (see `plan`). A plan made
        before stays valid (an event due now applies the command too); re-plan to act sooner."""
        self.inbox.append(cmd)

    # ------------------------------------------------------------------ clock
    def plan(self, now: float) -> float | None:
        """Absolute time of the next event (a completion, or the boundary where the inbox applies);
        None when idle with nothing to do."""
        best: tuple[float, int] | None = None
        if self.running:
            while True:  # drop lazily deleted (aborted) entries
                _, uid, sid = self.heap[0]
                job = self.running.get(sid)
                if job is not None and job.uid == uid:
                    break
                heapq.heappop(self.heap)
            n = self.heap[0][0] - self.step
            if self.kv_tokens is not None:  # the boundary where the cache fills comes first
                n = min(n, max(0, (self.kv_free() - sum(self.ctx.values())) // len(self.running)))
            best = (self.t_b + self.segment.time(n), n)
        if self.inbox:
            if not self.running or now <= self.t_b:
                cand = (max(now, self.t_b), 0)
            else:
                n = self.segment.steps_within(now - self.t_b)
                if self.t_b + self.segment.time(n) < now:
                    n += 1  # a step is in progress: the command waits for its end
                cand = (self.t_b + self.segment.time(n), n)
            if best is None or cand[0] <= best[0]:
                best = cand
        self._plan = best
        return None if best is None else best[0]

    def fire(self) -> Report:
        """Advance to the planned event and apply everything due there."""
        if self._plan is None:
            raise RuntimeError(f"engine {self.id}: fire() without a plan")
        t, n = self._plan
        self._plan = None
        step, tokens, busy = self.step, self.gen_tokens, self.busy_time
        self._advance(n, t)
        rep = Report(
            steps=self.step - step, decode_tokens=self.gen_tokens - tokens, busy_s=self.busy_time - busy
        )
        self._finish(rep, t)
        for cmd in self.inbox:
            self._apply(cmd, rep)
        self.inbox = []
        self._preempt()
        self._admit()
        self._resegment()
        return rep

    def crash(self, now: float, back_at: float) -> None:
        """The engine's process dies at `now`: the decode steps finished by then count, everything in
        it is gone (queued and running requests, commands not yet applied: the scheduler requeues its
        samples), and it serves again from `back_at` with the versions it held. Commands posted in
        between wait for it."""
        if self.running:
            n = self.segment.steps_within(max(0.0, now - self.t_b))
            self._advance(n, self.t_b)
        self.queue.clear()
        self.running.clear()
        self.heap.clear()
        self.inbox = []
        self.count, self.ctx = {}, {}
        self._plan = None
        self.t_b = max(self.t_b, now)
        self._span("down", self.t_b, back_at)
        self.t_b = max(self.t_b, back_at)
        self.segment = Segment(0.0, ())

    # ------------------------------------------------------------------ internals
    def _advance(self, n: int, t: float) -> None:
        if n > 0:
            dt, busy = self.segment.time(n), self.segment.busy(n)
            active = sum(self.count.values())
            self.slot_time += active * busy
            self.busy_time += busy
            self.spec_busy += busy if self.spec_on else 0.0
            self.gen_tokens += active * n
            self._span("generate", self.t_b, self.t_b + dt)
            for v, b in self.count.items():
                self.ctx[v] += b * n
            self.step += n
            self.t_b += dt
        self.t_b = max(self.t_b, t)

    def _finish(self, rep: Report, t: float) -> None:
        while self.heap and self.heap[0][0] <= self.step:
            _, uid, sid = heapq.heappop(self.heap)
            job = self.running.get(sid)
            if job is None or job.uid != uid:
                continue
            self._remove(job)
            rep.results.append(self._result(job, Finish.LENGTH if job.truncated else Finish.STOP, t))

    def _apply(self, cmd, rep: Report) -> None:
        if isinstance(cmd, Generate):
            for s in cmd.requests:
                if s.version not in self.loaded:
                    raise RuntimeError(
                        f"engine {self.id}: request {s.id} needs version {s.version}, "
                        f"engine holds {sorted(self.loaded)}"
                    )
                queue_by_priority(self.queue, self._job(s), _priority)
                self.received.add(s.id)
        elif isinstance(cmd, Abort):
            ids = set(cmd.request_ids)
            unknown = ids - self.received
            if unknown:  # the real engine raises here too; one that already finished is a benign race
                raise RuntimeError(
                    f"engine {self.id}: abort of {sorted(unknown)}, which it was never sent "
                    "(commands apply in order: an Abort before its Generate finds nothing)"
                )
            queued = {j.request.id: j for j in self.queue if j.request.id in ids}
            self.queue = deque(j for j in self.queue if j.request.id not in queued)
            for sid in dict.fromkeys(cmd.request_ids):  # in the order named: never a set's (hash) order
                job = queued.get(sid) or self.running.get(sid)
                if job is None:
                    continue  # finished before the abort reached it
                if sid in self.running:
                    self._remove(job)
                rep.results.append(self._result(job, Finish.ABORTED, self.t_b))
        elif isinstance(cmd, LoadWeights):
            dt = self.cost.load_time()
            self._span("sync", self.t_b, self.t_b + dt, cmd.version)
            self.busy_time += dt
            self.t_b += dt
            self.loaded.add(cmd.version)
            rep.loaded.append((cmd.version, self.t_b))
        elif isinstance(cmd, DropWeights):
            if any(j.request.version == cmd.version for j in [*self.running.values(), *self.queue]):
                raise RuntimeError(
                    f"engine {self.id}: drop of version {cmd.version}, which requests still use"
                )
            self.loaded.discard(cmd.version)
        elif isinstance(cmd, CoRun):
            self.slowdown = cmd.factor
        elif isinstance(cmd, Stall):
            self._span("wait", self.t_b, self.t_b + cmd.seconds)
            self.t_b += cmd.seconds
            self.stalled += cmd.seconds
        elif isinstance(cmd, Block):
            if cmd.until > self.t_b:
                self._span("wait", self.t_b, cmd.until)
                self.t_b = cmd.until
        else:
            raise TypeError(f"engine {self.id}: unknown command {cmd!r}")

    def _job(self, r: GenRequest) -> Job:
        base = len(r.resume_ids)
        target = self.lengths.response(*self.describe(r.id))
        truncated = target >= self.lengths.max_len
        self._uid += 1
        return Job(r, len(r.prompt_ids), base, max(target, base + 1), truncated, self.t_b, self._uid)

    def kv_free(self) -> float:
        """Cache tokens sequences may hold: the capacity less the loaded versions beyond the first."""
        if self.kv_tokens is None:
            return float("inf")
        return self.kv_tokens - max(0, len(self.loaded) - 1) * self.cost.version_kv_tokens()

    def _preempt(self) -> None:
        """While the next step does not fit, the latest admitted sequence goes back to the queue front."""
        used = sum(self.ctx.values())
        while self.running and used + len(self.running) > self.kv_free():
            job = max(self.running.values(), key=lambda j: j.order)
            n = job.tokens(self.step)
            self._remove(job)
            used -= job.prompt_len + n
            job.done, job.start = n - job.base, -1
            self._uid += 1
            job.uid = self._uid  # its finish entry in the heap is stale now
            self.queue.appendleft(job)
            self.preemptions += 1

    def _admit(self) -> None:
        new, used, free = [], sum(self.ctx.values()), self.kv_free()
        while self.queue and len(self.running) + len(new) < self.slots:
            need = self.queue[0].prompt_len + self.queue[0].tokens(self.step)
            if used + need + len(self.running) + len(new) + 1 > free:
                if not self.running and not new:
                    raise RuntimeError(
                        f"engine {self.id}: request {self.queue[0].request.id} needs {need + 1} tokens of KV "
                        f"cache, the engine has {free:.0f}: give the engine more memory or cap its lengths"
                    )
                break
            new.append(self.queue.popleft())
            used += need
        if not new:
            return
        self.recomputed_tokens += sum(j.done for j in new)
        dt = self.cost.prefill_time([j.prompt_len + j.base + j.done for j in new])
        self._span("generate", self.t_b, self.t_b + dt)
        self.busy_time += dt
        # the running batch waits through the prefill; the new rows hold their slots during it (as the
        # real engine counts a row in its prefill step)
        self.slot_time += (len(self.running) + len(new)) * dt
        self.t_b += dt
        for job in new:
            job.start = self.step
            job.first_token = job.first_token or self.t_b
            self._order += 1
            job.order = self._order
            self.running[job.request.id] = job
            v = job.request.version
            self.count[v] = self.count.get(v, 0) + 1
            self.ctx[v] = self.ctx.get(v, 0) + job.prompt_len + job.base + job.done
            heapq.heappush(self.heap, (self.step + job.target - job.base - job.done, job.uid, job.request.id))

    def _remove(self, job: Job) -> None:
        del self.running[job.request.id]
        v = job.request.version
        self.count[v] -= 1
        self.ctx[v] -= job.prompt_len + job.tokens(self.step)
        if not self.count[v]:
            del self.count[v], self.ctx[v]

    def _resegment(self) -> None:
        batch = {v: (b, self.ctx[v]) for v, b in self.count.items()}
        self.segment = self.cost.decode_segment(batch)
        self.spec_on = False
        if self.spec is not None and batch:  # the toggle: speculate where the cost model says it pays
            alpha, gamma, min_speedup = self.spec
            f = self.cost.spec_factor(batch, alpha, gamma)
            if f * min_speedup <= 1.0:  # a step now stands for the expected tokens of a verify step
                self.segment, self.spec_on = self.segment.scaled(f), True
        if self.slowdown != 1.0:
            self.segment = self.segment.scaled(self.slowdown)

    def _span(self, phase: str, t0: float, t1: float, version: int | None = None) -> None:
        if t1 <= t0:
            return
        last = self.spans[-1] if self.spans else None
        if last is not None and last.phase == phase == "generate" and t0 - last.t1 < 1e-12:
            last.t1 = t1  # back-to-back work is one span
        else:
            self.spans.append(Span(phase, t0, t1, version))

    def _result(self, job: Job, finish: Finish, t: float) -> GenResult:
        r = job.request
        new = job.tokens(self.step) - job.base
        ids, lps, vs = Runs.of(TOKEN, new), Runs.of(-1.0, new), Runs.of(r.version, new)
        if job.base:  # a resumed partial: its old tokens keep their own versions
            ids = Runs.from_seq(r.resume_ids) + ids
            lps = Runs.from_seq(r.resume_logprobs) + lps
            vs = Runs.from_seq(r.resume_versions) + vs
        return GenResult(r.id, ids, lps, vs, finish, job.submitted, job.first_token, t)

    # ------------------------------------------------------------------ accounting
    def _busy_since_boundary(self, now: float) -> float:
        """Busy time of the current segment's part already run (host gaps after whole steps excluded)."""
        if now <= self.t_b or not self.running:
            return 0.0
        if not self.segment.gap:
            return now - self.t_b
        return (now - self.t_b) - self.segment.steps_within(now - self.t_b) * self.segment.gap

    def busy_time_at(self, now: float) -> float:
        """Decoding time up to `now`, counting the part of the current segment already run."""
        return self.busy_time + self._busy_since_boundary(now)

    def slot_time_at(self, now: float) -> float:
        """Slot-time up to `now`, counting the part of the current segment already run."""
        return self.slot_time + len(self.running) * self._busy_since_boundary(now)


def _group_and_index(request_id: str) -> tuple[int, int]:
    key = SampleKey.parse(request_id)
    return key.group, key.index


def _priority(job: Job) -> tuple:
    return job.request.priority
