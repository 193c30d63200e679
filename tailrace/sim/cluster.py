"""`SimCluster`: the real `Scheduler` and its policy driving simulated engines and a simulated trainer
under SimPy's virtual clock.

    poll the scheduler -> hand its commands to engines / the trainer -> wait for the next event ->
    feed the reports back (on_results, on_loaded, on_trained, on_published) -> poll again

Each engine and the trainer is a SimPy process. An engine sleeps until its next planned event (a
completion, or the step boundary where newly posted commands apply) or until a command wakes it to
re-plan; the trainer works through its FIFO of train steps. Polls are coalesced: every report at one
instant is fed in, then the scheduler is polled once, as the real driver does with a batch of
reports. With `poll_s` > 0 the driver polls at most every `poll_s` virtual seconds (reports between
are fed in as they come), like a driver that batches reports; at GPU scale, where a round takes
minutes, a fraction of a second of dispatch latency changes nothing and saves most polls.
The scheduler checks its invariants (staleness, one version per trajectory, ledger) as it
does in a real run; a violation raises out of `run()`.
"""

from __future__ import annotations

from collections import deque

import simpy

from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Train
from tailrace.flow.keys import SampleKey
from tailrace.sim.costs import CostModel
from tailrace.sim.engine import Block, CoRun, SimEngine, Span, Stall
from tailrace.sim.failures import FailureLog, FailureSpec
from tailrace.sim.lengths import P_REWARD, uniform
from tailrace.sim.recorder import Recorder
from tailrace.types import Finish, GenResult, Scored


class SimStalled(RuntimeError):
    pass


class SimCluster:
    def __init__(
        self,
        sched,
        engines: list[SimEngine],
        cost: CostModel,
        recorder: Recorder | None = None,
        colocated: bool = False,
        poll_s: float = 0.0,
        accuracy: float = 0.5,
        seed: int = 0,
        failures: FailureSpec | None = None,
    ) -> None:
        """`accuracy`: the chance that a sample is scored correct (reward 1), drawn per (prompt,
        sample index) from `seed`: the cluster scores results as the real driver does. `failures`:
        workers die and come back (see `sim.failures`); the cost lands in `failure_log`."""
        if len(engines) != len(sched.engines):
            raise ValueError(
                f"{len(engines)} simulated engines for a scheduler built with {len(sched.engines)}"
            )
        self.sched, self.engines, self.cost = sched, engines, cost
        self.accuracy, self.seed = accuracy, seed
        for e in engines:
            e.describe = self._describe
        self.rec = recorder or Recorder()
        self.colocated = colocated  # training holds the engines' devices: engines pause while it runs
        self.env = simpy.Environment()
        self.wakes = [self.env.event() for _ in engines]
        self.train_queue: deque[Train] = deque()
        self.train_wake = self.env.event()
        self.trainer_spans: list[Span] = []
        self.trainer_busy = 0.0
        self.training = False  # the trainer is computing (not syncing or waiting)
        self.done = self.env.event()
        self._poll_pending = False
        self.poll_s = poll_s
        self._last_poll = -float("inf")
        self.events = 0
        self._progress = 0  # samples finished and steps trained: failures that let none happen livelock
        for e in engines:
            self.env.process(self._engine_proc(e))
        self.env.process(self._trainer_proc())
        self.failures = failures if failures is not None and failures.active else None
        self.failure_log = FailureLog()
        if self.failures is not None:
            for e in engines:
                self.env.process(self._engine_failures(e))
            self._trainer_clock = self.failures.arrivals(len(engines), self.failures.trainer_mtbf_s)
            self._trainer_fail_at = self._trainer_clock.next()
            self._progress_at_failure, self._failures_since = 0, 0
            self._since_checkpoint = 0.0  # trainer compute since its last checkpoint (redone after a failure)

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
        self.rec.finish(self)

    def _stall_message(self) -> str:
        s = self.sched
        return (
            f"simulation stalled at t={self.env.now:.3f}s after {s.steps_done}/{s.spec.total_steps} steps: "
            f"nothing is running and the policy {s.policy.name!r} issued no work "
            f"(open groups {len(s.open)}, ready {len(s.ready)}, in flight {s.in_flight()}, "
            f"published {sorted(s.published)})"
        )

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
        out = self.sched.poll(self.now)
        self.rec.record(out)
        for c in out.commands:
            self._execute(c)

    def _execute(self, c) -> None:
        if isinstance(c, (Generate, Abort, LoadWeights, DropWeights)):
            self._post(c.engine, c)
        elif isinstance(c, Train):
            self.rec.on_train_issued(c, self.now)
            self.train_queue.append(c)
            self._wake(self.train_wake)
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
                self.sched.on_engine_steps(rep.steps, rep.decode_tokens, 0, rep.busy_s)
            if rep.results:
                self._progress += len(rep.results)
                self.sched.on_results(eng.id, rep.results, self._score(rep.results), env.now)
                hw = self.cost.hw
                if self.training and not self.colocated and (hw.driver_report_s or hw.driver_result_s):
                    # the driver handles the report on this engine's host core (the trainer's is busy)
                    eng.post(Stall(hw.driver_report_s + hw.driver_result_s * len(rep.results)))
            for version, t in rep.loaded:
                ev = env.timeout(t - env.now)
                ev.callbacks.append(lambda _e, i=eng.id, v=version: self._loaded(i, v))
            self._request_poll()

    def _describe(self, request_id: str) -> tuple[int, int]:
        """(prompt id, sample index) of a request: what the length model and the reward key on."""
        return self.sched.prompt_of(request_id).id, SampleKey.parse(request_id).index

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
            log.requeued += self.sched.on_engine_lost(eng.id, env.now)
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
            who = "the trainer" if worker < 0 else f"engine {worker}"
            raise SimStalled(
                f"simulation livelocked at t={self.env.now:.1f}s: {self._failures_since} failures in a row "
                f"(the last of {who}) with no sample finished and no step trained in between; workers "
                f"fail faster than they finish work (failures.engine_mtbf_s={f.engine_mtbf_s}, "
                f"failures.trainer_mtbf_s={f.trainer_mtbf_s}, restart {f.detect_s + f.restart_s:.1f}s). "
                "Raise the mean times between failures or shorten the responses and steps"
            )

    def _trainer_failures(self, step_s: float):
        """Before a step of `step_s` seconds: wait out a restart the trainer is in, and for each
        failure that would land inside the step, lose the part done, restart, redo the steps since
        the last checkpoint, and try again."""
        f, env, log = self.failures, self.env, self.failure_log
        while self._trainer_fail_at < env.now + step_s:
            tf = self._trainer_fail_at  # in this step, or earlier while the trainer waited for data
            lost = max(0.0, tf - env.now)  # the part of this step done before the failure
            yield env.timeout(lost)
            self._check_progress(-1)
            log.trainer += 1
            log.events.append((tf, "trainer", 0))
            back = tf + f.detect_s + f.restart_s  # a replacement holds the last checkpoint's weights
            self.trainer_spans.append(Span("down", env.now, max(env.now, back)))
            log.trainer_down_s += max(0.0, back - env.now)
            yield env.timeout(max(0.0, back - env.now) + self._since_checkpoint)
            log.trainer_redo_s += lost + self._since_checkpoint
            self._trainer_fail_at = self._trainer_clock.next()

    def _loaded(self, engine: int, version: int) -> None:
        self.sched.on_loaded(engine, version, self.now)
        self._request_poll()

    def _trainer_proc(self):
        env = self.env
        while True:
            if not self.train_queue:
                self.train_wake = env.event()
                yield self.train_wake
                continue
            c = self.train_queue.popleft()
            lengths = [len(t.prompt_ids) + t.length for g in c.groups for t in g.trajectories]
            dt = self.cost.train_time(lengths)
            pub = self.cost.publish_time() if c.publish is not None else 0.0
            ckpt = self.cost.checkpoint_s if c.publish is not None else 0.0
            if self.failures is not None:
                yield from self._trainer_failures(dt + pub + ckpt)
            t0 = env.now
            corun = self.cost.hw.corun_slowdown if not self.colocated else 1.0
            if self.colocated:
                self._post_all(Block(t0 + dt + pub + ckpt))
            elif corun != 1.0:
                self._post_all(CoRun(corun))
            self.training = True
            yield env.timeout(dt)
            self.training = False
            if corun != 1.0:
                self._post_all(CoRun(1.0))
            self.trainer_spans.append(Span("train", t0, env.now))
            self.trainer_busy += dt
            self._progress += 1
            sync = None
            if pub:
                yield env.timeout(pub)
                self.trainer_spans.append(Span("sync", t0 + dt, env.now, c.publish))
                sync = (t0 + dt, env.now)
            if ckpt:
                yield env.timeout(ckpt)
                self.trainer_spans.append(Span("checkpoint", env.now - ckpt, env.now))
            if self.failures is not None:
                self._since_checkpoint = 0.0 if c.publish is not None else self._since_checkpoint + dt
            self.events += 1
            self.sched.on_train_step([t.length for g in c.groups for t in g.trajectories], dt)
            self.sched.on_trained(c.step, env.now)
            if c.publish is not None:
                self.sched.on_published(c.publish, env.now)
            self.rec.on_trained(self, c, sum(lengths), (t0, t0 + dt), sync)
            if self.sched.done:
                self.rec.record(self.sched.poll(env.now))
                self.done.succeed()
                return
            self._request_poll()
