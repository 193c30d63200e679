"""`SimCluster`: the real schedulers and their policies driving simulated engines and simulated trainers
under SimPy's virtual clock.

    poll the policies -> hand their commands to engines / their trainers -> wait for the next event ->
    feed the reports back (on_results, on_loaded, on_trained, on_published) -> poll again

It drives a `flow.multi.PolicySet` (a lone Scheduler is a set of one policy): the engines are shared
(they hold every policy's weights, in the set's version space), each policy has a trainer of its own
(its own devices: the cost model's `trainer_gpus` each), and the run ends when every policy has
trained its steps. Each engine and each trainer is a SimPy process. An engine sleeps until its next
planned event (a completion, or the step boundary where newly posted commands apply) or until a
command wakes it to re-plan; a trainer works through its FIFO of train steps. Polls are coalesced:
every report at one instant is fed in, then the policies are polled once, as the real driver does
with a batch of reports. With `poll_s` > 0 the driver polls at most every `poll_s` virtual seconds
(reports between are fed in as they come), like a driver that batches reports; at GPU scale, where a
round takes minutes, a fraction of a second of dispatch latency changes nothing and saves most polls.
Each scheduler checks its invariants (staleness, one version per trajectory, ledger) as it does in a
real run; a violation raises out of `run()`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import simpy

from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Train
from tailrace.flow.keys import SampleKey
from tailrace.flow.multi import PolicySet
from tailrace.flow.scheduler import Scheduler
from tailrace.sim.costs import CostModel
from tailrace.sim.engine import Block, CoRun, SimEngine, Span, Stall
from tailrace.sim.failures import FailureClock, FailureLog, FailureSpec
from tailrace.sim.lengths import P_REWARD, uniform
from tailrace.sim.recorder import Recorder, run_summary
from tailrace.types import Finish, GenResult, Scored


class SimStalled(RuntimeError):
    pass


@dataclass
class SimTrainer:
    """One policy's trainer, on devices of its own: its FIFO of train steps and what it has done."""

    policy: int
    wake: simpy.Event
    queue: deque[Train] = field(default_factory=deque)
    spans: list[Span] = field(default_factory=list)
    busy: float = 0.0  # seconds computing
    training: bool = False  # computing (not syncing or waiting)
    clock: FailureClock | None = None  # its failure times (failures on)
    fail_at: float = float("inf")
    since_checkpoint: float = 0.0  # compute since its last checkpoint (redone after a failure)


class SimCluster:
    def __init__(
        self,
        policies: PolicySet | Scheduler,
        engines: list[SimEngine],
        cost: CostModel,
        recorder: Recorder | Sequence[Recorder] | None = None,
        colocated: bool = False,
        poll_s: float = 0.0,
        accuracy: float = 0.5,
        seed: int = 0,
        failures: FailureSpec | None = None,
        joins: Sequence[tuple[float, str, Scheduler, Recorder]] = (),
    ) -> None:
        """`recorder`: one per policy. `accuracy`: the chance that a sample is scored correct (reward
        1), drawn per (prompt, sample index) from `seed`: the cluster scores results as the real driver
        does. `failures`: workers die and come back (see `sim.failures`); the cost lands in
        `failure_log`. The engines must start holding what the policies' books say they hold (every
        policy's version 0: `SimEngine(start_versions=...)`). `joins`: (virtual seconds, name,
        scheduler, recorder) of each policy that joins the running set then (`PolicySet.add`, as
        `tailrace policy join` does: its trainer on devices of its own), the set's room made for them."""
        self.policies = policies if isinstance(policies, PolicySet) else PolicySet(["policy"], [policies])
        n = len(self.policies)
        if len(engines) != len(self.policies.engines):
            raise ValueError(
                f"{len(engines)} simulated engines for schedulers built with {len(self.policies.engines)}"
            )
        for e in engines:
            if e.loaded != self.policies.loaded(e.id):
                raise ValueError(
                    f"engine {e.id} starts holding versions {sorted(e.loaded)}, the policies' books say "
                    f"{sorted(self.policies.loaded(e.id))}: build it with those start_versions"
                )
        if colocated and n > 1:
            raise ValueError(
                "colocated training of several policies is not modelled: give each trainer devices"
            )
        if isinstance(recorder, Recorder):
            recorder = [recorder]
        recs = list(recorder) if recorder is not None else [Recorder() for _ in range(n)]
        if len(recs) != n:
            raise ValueError(f"{len(recs)} recorders for {n} policies: give one each")
        self.engines, self.cost, self.recs = engines, cost, recs
        self.accuracy, self.seed = accuracy, seed
        for e in engines:
            e.describe = self._describe
        self.colocated = colocated  # training holds the engines' devices: engines pause while it runs
        self.env = simpy.Environment()
        self.wakes = [self.env.event() for _ in engines]
        self.trainers: list[SimTrainer] = []
        self.done = self.env.event()
        self._poll_pending = False
        self.poll_s = poll_s
        self._last_poll = -float("inf")
        self.events = 0
        self._progress = 0  # samples finished and steps trained: failures that let none happen livelock
        self.failures = failures if failures is not None and failures.active else None
        self.failure_log = FailureLog()
        for e in engines:
            self.env.process(self._engine_proc(e))
        for p in range(n):
            self._add_trainer(p)
        if self.failures is not None:
            for e in engines:
                self.env.process(self._engine_failures(e))
            self._progress_at_failure, self._failures_since = 0, 0
        self._joining = len(joins)  # policies still to join: the run is not done before they are
        for at, name, sched, rec in joins:
            self.env.process(self._join(at, name, sched, rec))

    def _add_trainer(self, p: int) -> None:
        """Policy p's trainer, on devices of its own (failures on: its worker id after the engines')."""
        tr = SimTrainer(p, self.env.event())
        if self.failures is not None:
            tr.clock = self.failures.arrivals(len(self.engines) + p, self.failures.trainer_mtbf_s)
            tr.fail_at = tr.clock.next()
        self.trainers.append(tr)
        self.env.process(self._trainer_proc(tr))

    def _join(self, at: float, name: str, sched: Scheduler, rec: Recorder):
        yield self.env.timeout(at)
        self.recs.append(rec)
        self._add_trainer(self.policies.add(name, sched))
        self._joining -= 1
        self._request_poll()

    # a single-policy run's scheduler, recorder and trainer (the first policy's of several)
    @property
    def sched(self) -> Scheduler:
        return self.policies[0]

    @property
    def rec(self) -> Recorder:
        return self.recs[0]

    @property
    def trainer_spans(self) -> list[Span]:
        return self.trainers[0].spans

    @property
    def trainer_busy(self) -> float:
        return self.trainers[0].busy

    # ------------------------------------------------------------------ the loop
    def run(self, max_time: float | None = None) -> None:
        self._request_poll()
        until = (
            self.done if max_time is None else simpy.AnyOf(self.env, [self.done, self.env.timeout(max_time)])
        )
        try:
            self.env.run(until=until)
        except RuntimeError as e:
            if "No scheduled events left" not in str(e):
                raise
            raise SimStalled(self._stall_message()) from None
        for p, rec in enumerate(self.recs):
            rec.finish(self, p)
        self.summary = run_summary(self)

    def _stall_message(self) -> str:
        several = len(self.policies) > 1
        stuck = [
            (f"policy {name}: " if several else "")
            + f"{s.policy.name!r} issued no work after {s.steps_done}/{s.spec.total_steps} steps (open "
            f"groups {len(s.open)}, ready {len(s.ready)}, in flight {s.in_flight()}, published {sorted(s.published)})"
            for name, s in zip(self.policies.names, self.policies)
            if not s.done
        ]
        return f"simulation stalled at t={self.env.now:.3f}s: nothing is running and " + "; ".join(stuck)

    @property
    def now(self) -> float:
        return self.env.now

    def _request_poll(self) -> None:
        if self._poll_pending or self.done.triggered:
            return
        self._poll_pending = True
        ev = self.env.timeout(max(0.0, self._last_poll + self.poll_s - self.now))
        ev.callbacks.append(self._poll)

    def _poll(self, _event=None) -> None:
        self._poll_pending = False
        if self.done.triggered:
            return
        self._last_poll = self.now
        for rec, out in zip(self.recs, self.policies.poll(self.now)):
            rec.record(out)
            for c in out.commands:
                self._execute(c)

    def _execute(self, c) -> None:
        if isinstance(c, (Generate, Abort, LoadWeights, DropWeights)):
            self._post(c.engine, c)
        elif isinstance(c, Train):
            self.recs[c.policy].on_train_issued(c, self.now)
            tr = self.trainers[c.policy]
            tr.queue.append(c)
            self._wake(tr.wake)
        else:
            raise TypeError(f"unknown command {c!r}")

    def _post(self, engine: int, cmd) -> None:
        self.engines[engine].post(cmd)
        self._wake(self.wakes[engine])

    def _post_all(self, cmd) -> None:
        for e in self.engines:
            self._post(e.id, cmd)

    @staticmethod
    def _wake(ev) -> None:
        if not ev.triggered:
            ev.succeed()

    # ------------------------------------------------------------------ processes
    def _engine_proc(self, eng: SimEngine):
        env = self.env
        while True:
            when = eng.plan(env.now)
            wake = self.wakes[eng.id] = env.event()
            if when is None:
                yield wake
                continue
            timer = env.timeout(max(0.0, when - env.now))
            fired = yield timer | wake
            if timer not in fired:
                continue  # a command arrived: re-plan
            rep = eng.fire()
            self.events += 1
            if rep.steps:
                self.policies.on_engine_steps(rep.steps, rep.decode_tokens, 0, rep.busy_s)
            if rep.results:
                self._progress += len(rep.results)
                self.policies.on_results(eng.id, rep.results, self._score(rep.results), env.now)
                hw = self.cost.hw
                if self._computing and not self.colocated and (hw.driver_report_s or hw.driver_result_s):
                    # the driver handles the report on this engine's host core (the trainer's is busy)
                    eng.post(Stall(hw.driver_report_s + hw.driver_result_s * len(rep.results)))
            for version, t in rep.loaded:
                ev = env.timeout(t - env.now)
                ev.callbacks.append(lambda _e, i=eng.id, v=version: self._loaded(i, v))
            self._request_poll()

    @property
    def _computing(self) -> bool:
        """Some trainer is computing (not syncing or waiting)."""
        return any(tr.training for tr in self.trainers)

    def _describe(self, request_id: str) -> tuple[int, int]:
        """(prompt id, sample index) of a request: what the length model and the reward key on."""
        p, rid = self.policies.split(request_id)
        return self.policies[p].prompt_of(rid).id, SampleKey.parse(rid).index

    def _score(self, results: list[GenResult]) -> list[Scored]:
        out = []
        for r in results:
            if r.finish != Finish.ABORTED:
                ok = uniform(self.seed, P_REWARD, *self._describe(r.request_id)) < self.accuracy
                out.append(Scored(r.request_id, float(ok), ok))
        return out

    # ------------------------------------------------------------------ failures
    def _engine_failures(self, eng: SimEngine):
        """Kill `eng` at its failure times; its replacement serves after detection, restart and
        reloading the versions it held."""
        f, env = self.failures, self.env
        clock = f.arrivals(eng.id, f.engine_mtbf_s)
        while True:
            t = clock.next()
            if t == float("inf"):
                return
            yield env.timeout(t - env.now)
            if self.done.triggered:
                return
            self._check_progress(eng.id)
            down = f.detect_s + f.restart_s + self.cost.load_time() * len(eng.loaded)
            eng.crash(env.now, env.now + down)
            log = self.failure_log
            log.engine += 1
            log.engine_down_s += down
            log.requeued += self.policies.on_engine_lost(eng.id, env.now)
            log.events.append((env.now, "engine", eng.id))
            self._wake(self.wakes[eng.id])
            self._request_poll()

    FAILURES_WITHOUT_PROGRESS = 200

    def _check_progress(self, worker: int) -> None:
        """Failures so frequent that no sample finishes and no step trains would run forever: stop
        with the figures to change instead."""
        if self._progress != self._progress_at_failure:
            self._progress_at_failure, self._failures_since = self._progress, 0
            return
        self._failures_since += 1
        if self._failures_since >= self.FAILURES_WITHOUT_PROGRESS:
            f = self.failures
            if worker >= 0:
                who = f"engine {worker}"
            else:
                who = (
                    "the trainer"
                    if len(self.trainers) == 1
                    else f"{self.policies.names[-1 - worker]}'s trainer"
                )
            raise SimStalled(
                f"simulation livelocked at t={self.env.now:.1f}s: {self._failures_since} failures in a row "
                f"(the last of {who}) with no sample finished and no step trained in between; workers "
                f"fail faster than they finish work (failures.engine_mtbf_s={f.engine_mtbf_s}, "
                f"failures.trainer_mtbf_s={f.trainer_mtbf_s}, restart {f.detect_s + f.restart_s:.1f}s). "
                "Raise the mean times between failures or shorten the responses and steps"
            )

    def _trainer_failures(self, tr: SimTrainer, step_s: float):
        """Before a step of `step_s` seconds: wait out a restart the trainer is in, and for each
        failure that would land inside the step, lose the part done, restart, redo the steps since
        the last checkpoint, and try again."""
        f, env, log = self.failures, self.env, self.failure_log
        while tr.fail_at < env.now + step_s:
            tf = tr.fail_at  # in this step, or earlier while the trainer waited for data
            lost = max(0.0, tf - env.now)  # the part of this step done before the failure
            yield env.timeout(lost)
            self._check_progress(-1 - tr.policy)
            log.trainer += 1
            log.events.append((tf, "trainer", tr.policy))
            back = tf + f.detect_s + f.restart_s  # a replacement holds the last checkpoint's weights
            tr.spans.append(Span("down", env.now, max(env.now, back)))
            log.trainer_down_s += max(0.0, back - env.now)
            yield env.timeout(max(0.0, back - env.now) + tr.since_checkpoint)
            log.trainer_redo_s += lost + tr.since_checkpoint
            tr.fail_at = tr.clock.next()

    def _loaded(self, engine: int, version: int) -> None:
        self.policies.on_loaded(engine, version, self.now)
        self._request_poll()

    def _trainer_proc(self, tr: SimTrainer):
        env, sched, rec = self.env, self.policies[tr.policy], self.recs[tr.policy]
        while True:
            if not tr.queue:
                tr.wake = env.event()
                yield tr.wake
                continue
            c = tr.queue.popleft()
            lengths = [len(t.prompt_ids) + t.length for g in c.groups for t in g.trajectories]
            dt = self.cost.train_time(lengths)
            pub = self.cost.publish_time() if c.publish is not None else 0.0
            ckpt = self.cost.checkpoint_s if c.publish is not None else 0.0
            if self.failures is not None:
                yield from self._trainer_failures(tr, dt + pub + ckpt)
            t0 = env.now
            corun = self.cost.hw.corun_slowdown if not self.colocated else 1.0
            if self.colocated:
                self._post_all(Block(t0 + dt + pub + ckpt))
            elif corun != 1.0:
                self._post_all(CoRun(corun))
            tr.training = True
            yield env.timeout(dt)
            tr.training = False
            if corun != 1.0 and not self._computing:  # the last trainer computing stopped
                self._post_all(CoRun(1.0))
            tr.spans.append(Span("train", t0, env.now))
            tr.busy += dt
            self._progress += 1
            sync = None
            if pub:
                yield env.timeout(pub)
                tr.spans.append(Span("sync", t0 + dt, env.now, c.publish))
                sync = (t0 + dt, env.now)
            if ckpt:
                yield env.timeout(ckpt)
                tr.spans.append(Span("checkpoint", env.now - ckpt, env.now))
            if self.failures is not None:
                tr.since_checkpoint = 0.0 if c.publish is not None else tr.since_checkpoint + dt
            self.events += 1
            sched.on_train_step([t.length for g in c.groups for t in g.trajectories], dt)
            sched.on_trained(c.step, env.now)
            if c.publish is not None:
                sched.on_published(c.publish, env.now)
            rec.on_trained(self, c, sum(lengths), (t0, t0 + dt), sync)
            if self.policies.done and not self._joining:
                for r, out in zip(self.recs, self.policies.poll(env.now)):
                    r.record(out)
                self.done.succeed()
                return
            self._request_poll()
