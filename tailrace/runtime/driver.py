"""The local driver: scheduler in this process, trainer and engines in their own pinned processes.

    poll the scheduler -> execute its commands, record its journal and marks -> wait for reports
    -> score engine results and feed them back -> log

Engines report finished results in batches; the driver scores them (RewardGuard: timeouts, never
crashes the run) and hands results and scores to the scheduler, which builds the trajectories. The
trainer reports each finished step (durable when a checkpoint was asked for). Everything the run
produces is appended to the run directory as it happens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from pathlib import Path

from tailrace.config import RunConfig
from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Train
from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Outbox, Scheduler
from tailrace.metrics import step_record
from tailrace.records import EvalRecord, Span, StepRecord, journal_from_json, read_lines, read_metrics
from tailrace.runtime.engine_worker import EngineSpec, engine_main
from tailrace.runtime.evaluate import Evaluator
from tailrace.runtime.messages import EngineReport, Ready, Shutdown, TrainerReport, TrainOrder
from tailrace.runtime.metrics import Utilization
from tailrace.runtime.procs import context, placement
from tailrace.runtime.rundir import RecordFile, RunDir, truncate_metrics
from tailrace.runtime.session import Session
from tailrace.runtime.trainer_worker import TrainerSpec, trainer_main
from tailrace.runtime.weights import SharedWeights
from tailrace.types import Finish, GenResult, SamplingParams, Trajectory


@dataclass
class Summary:
    steps: int
    wall_s: float
    base_accuracy: float | None
    final_accuracy: float | None
    run_dir: str


class Driver:
    def __init__(
        self, cfg: RunConfig, run: RunDir, session: Session, resume_from: Path | None = None, ui=None
    ) -> None:
        self.cfg, self.run, self.ses, self.ui = cfg, run, session, ui
        self.resume_from = resume_from
        f, r = cfg.flow, cfg.rollout
        spec = FlowSpec(f.prompts_per_round, f.samples_per_prompt, f.groups_per_step, f.steps)
        policy = make_policy(
            f.mode, f.zero_signal, f.extra_groups, max_staleness=f.max_staleness, frontier=f.frontier,
            rollout_groups=f.rollout_groups,
        )  # fmt: skip
        sampling = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=session.stop_ids,
        )
        engines = [(r.slots, r.lookahead)] * r.engines
        self.sched = Scheduler(policy, session.prompt_stream(), engines, spec, sampling, seed=cfg.seed)
        self.metrics = RecordFile(run.file("metrics.jsonl"))
        self.events = RecordFile(run.file("events.jsonl"))
        self.journal = RecordFile(run.file("journal.jsonl"))
        self.tb = _tensorboard(run) if cfg.tensorboard else None
        self.pending_trajs: dict[int, tuple[int, list[Trajectory]]] = {}  # step -> (version, trajectories)
        self._eval_wanted: set[str] = set()  # ids of held-out requests not yet returned
        self._eval_results: list[GenResult] = []
        self._last_wall = 0.0  # the newest step record's wall_s: when the newest weights were published

    # ------------------------------------------------------------------ set-up
    def _restore(self) -> int:
        """Load the scheduler checkpoint and replay the journal; returns the version to start from."""
        state = json.loads((self.resume_from / "scheduler.json").read_text())
        self.sched.load_state_dict(state)
        lines = list(read_lines(self.run.file("journal.jsonl")))[state["journal_seq"] :]
        self.sched.replay(journal_from_json(d) for d in lines)
        done = state["steps_done"]
        truncate_metrics(
            self.run.file("metrics.jsonl"), lambda r: not isinstance(r, StepRecord) or r.step < done
        )
        self.metrics = RecordFile(self.run.file("metrics.jsonl"))
        return state["version"]

    def _start(self, version: int) -> None:
        ctx = context()
        cfg, ses = self.cfg, self.ses
        train_cores, engine_cores = placement(cfg.rollout.engines)
        self.weights = SharedWeights.like(ses.flat_layout(), slots=cfg.flow.max_staleness + 3)
        self.trainer_conn, child = ctx.Pipe()
        tspec = TrainerSpec(
            str(ses.model_path),
            cfg.train,
            threads=len(train_cores),
            cores=train_cores,
            seed=cfg.seed,
            start_version=version,
            resume_from=str(self.resume_from) if self.resume_from else None,
        )
        self.trainer = ctx.Process(target=trainer_main, args=(tspec, child, self.weights), daemon=True)
        self.trainer.start()
        _expect_ready(self.trainer_conn, self.trainer, "trainer")
        r = cfg.rollout
        self.engine_conns, self.engine_procs = [], []
        for i, cores in enumerate(engine_cores):
            espec = EngineSpec(
                str(ses.model_path), r.slots, r.prefill_tokens, r.threads, cores, cfg.seed, cfg.model.dtype,
                start_version=version, attention=r.attention, max_context=r.max_context, kv_memory_gb=r.kv_memory_gb,
            )  # fmt: skip
            conn, child = ctx.Pipe()
            p = ctx.Process(target=engine_main, args=(i, espec, child, self.weights), daemon=True)
            p.start()
            self.engine_conns.append(conn)
            self.engine_procs.append(p)
        for conn, p in zip(self.engine_conns, self.engine_procs):
            _expect_ready(conn, p, "engine")
        self.t0 = time.perf_counter()
        self.util = Utilization(self.t0, slots=r.slots * r.engines)

    def close(self) -> None:
        for conn in [getattr(self, "trainer_conn", None), *getattr(self, "engine_conns", [])]:
            if conn is not None:
                try:
                    conn.send(Shutdown())
                except (BrokenPipeError, OSError):
                    pass
        for p in [getattr(self, "trainer", None), *getattr(self, "engine_procs", [])]:
            if p is not None and p.pid is not None:  # a process that failed before start has nothing to join
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        for f in (self.metrics, self.events, self.journal):
            f.close()
        if self.tb is not None:
            self.tb.close()

    # ------------------------------------------------------------------ the loop
    def train(self) -> Summary:
        version = self._restore() if self.resume_from else 0
        self._start(version)
        evaluator = Evaluator(self.ses, self.cfg.eval) if self.cfg.eval.n else None
        base = self._recorded_eval("base")
        if base is None and evaluator is not None:
            base = self._evaluate(evaluator, "base", version, wall_s=0.0)
        # utilization counts from here: the base evaluation is not part of the training timeline
        self.util = Utilization(time.perf_counter(), slots=self.util.slots)
        self._cpu_mark = time.process_time()
        if self.ui is not None:
            self.ui.begin(self.sched.steps_done, self.cfg.flow.steps, base)
        limit = self.cfg.flow.time_limit_s
        while not self.sched.done:
            if (
                limit is not None
                and self._now() > limit
                and self.sched.spec.total_steps > self.sched.steps_issued
            ):
                self.sched.stop()
            self._handle(self.sched.poll(self._now()))
            for conn in wait([self.trainer_conn, *self.engine_conns], timeout=1.0):
                self._receive(conn)
            self._check_alive()
        self._handle(self.sched.poll(self._now()), sync=True)
        final = None
        if evaluator is not None:
            self._load_final()
            final = self._evaluate(evaluator, "final", self.sched.done_version, self._last_wall)
        return Summary(
            self.sched.steps_done,
            self._now(),
            base.accuracy if base else None,
            final.accuracy if final else None,
            str(self.run.path),
        )

    def _recorded_eval(self, tag: str) -> EvalRecord | None:
        records = read_metrics(self.run.file("metrics.jsonl"))
        return next((r for r in records if isinstance(r, EvalRecord) and r.tag == tag), None)

    def _evaluate(self, evaluator: Evaluator, tag: str, version: int, wall_s: float) -> EvalRecord:
        """Held-out requests through the engines' command path; the scheduler is idle meanwhile.
        `wall_s`: when `version` was published, on the step records' clock."""
        reqs = evaluator.requests(version)
        self._eval_wanted = {r.id for r in reqs}
        n = len(self.engine_conns)
        for i, conn in enumerate(self.engine_conns):
            conn.send(Generate(i, tuple(reqs[i::n])))
        while self._eval_wanted:
            for conn in wait(self.engine_conns, timeout=5.0):
                self._receive(conn)
        results, self._eval_results = self._eval_results, []
        rec = EvalRecord(tag, self.sched.steps_done, evaluator.summarize(reqs, results), version, wall_s)
        self.metrics.write(rec)
        return rec

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _handle(self, out: Outbox, sync: bool = False) -> None:
        """Append a poll's records (the journal first: it is the write-ahead log), then execute its
        commands."""
        self._record(out, sync)
        for c in out.commands:
            if isinstance(c, (Generate, Abort, LoadWeights, DropWeights)):
                self.engine_conns[c.engine].send(c)
            elif isinstance(c, Train):
                self._send_train(c)

    def _record(self, out: Outbox, sync: bool = False) -> None:
        for e in out.journal:
            self.journal.write(e)
        if sync:
            self.journal.sync()
        for m in out.marks:
            self.events.write(m)

    def _send_train(self, c: Train) -> None:
        every, steps = self.cfg.flow.checkpoint_every, self.cfg.flow.steps
        save = None
        if c.publish is not None and (c.step + 1) % every == 0 or c.step + 1 == steps:
            save = str(self.run.ckpt / f"step_{c.step + 1:06d}")
        self.pending_trajs[c.step] = (c.trainer_version, [t for g in c.groups for t in g.trajectories])
        self.trainer_conn.send(TrainOrder(c, save))

    def _receive(self, conn) -> None:
        msg = conn.recv()
        if isinstance(msg, EngineReport):
            self._on_engine_report(msg)
        elif isinstance(msg, TrainerReport):
            self._on_trainer_report(msg)

    def _on_engine_report(self, rep: EngineReport) -> None:
        st = rep.stats
        self.util.slot_time += st.slot_s
        self.util.engine_busy += st.busy_s
        self.util.gen_tokens += st.decode_tokens
        lane = f"engine{rep.engine}"
        for t0, t1 in st.spans:
            self.events.write(Span(lane, "generate", t0 - self.t0, t1 - self.t0))
        for v, t0, t1 in rep.loaded:
            self.events.write(Span(lane, "sync", t0 - self.t0, t1 - self.t0, version=v))
            self.sched.on_loaded(rep.engine, v, self._now())
        mine = []
        for r in rep.results:
            if r.request_id in self._eval_wanted:
                self._eval_wanted.discard(r.request_id)
                self._eval_results.append(r)
            else:  # the journal keeps request times on the run's clock, as events.jsonl
                t0 = self.t0
                mine.append(
                    replace(
                        r,
                        submitted=r.submitted - t0,
                        first_token=r.first_token - t0,
                        finished=r.finished - t0,
                    )
                )
        if mine:
            final = [r for r in mine if r.finish != Finish.ABORTED]
            scores = self.ses.score([self.sched.prompt_of(r.request_id) for r in final], final)
            self.sched.on_results(rep.engine, mine, scores, self._now())

    def _on_trainer_report(self, rep: TrainerReport) -> None:
        now = self._now()
        t0, t1 = rep.span
        self.util.trainer_busy += t1 - t0
        self.util.train_tokens += int(rep.metrics.get("tokens", 0))
        self.events.write(Span("trainer", "train", t0 - self.t0, t1 - self.t0, step=rep.step))
        if rep.sync_span:
            s0, s1 = rep.sync_span
            self.util.sync_time += s1 - s0
            self.events.write(Span("trainer", "sync", s0 - self.t0, s1 - self.t0, version=rep.published))
        self.sched.on_trained(rep.step, now)
        if rep.published is not None:
            self.sched.on_published(rep.published, now)
        trainer_version, trajs = self.pending_trajs.pop(rep.step)
        record = self._step_record(rep, trajs, trainer_version, now)
        if rep.saved:
            # everything the scheduler emitted up to now goes to disk before the state that counts it
            self._handle(self.sched.poll(self._now()), sync=True)
            (Path(rep.saved) / "scheduler.json").write_text(json.dumps(self.sched.state_dict()))
            self.run.set_latest(Path(rep.saved).name, self.cfg.flow.keep_checkpoints)
        self.metrics.write(record)
        if self.tb is not None:
            for key, value in _flatten(record.to_json()):
                self.tb.add_scalar(key, value, rep.step + 1)
        if self.ui is not None:
            self.ui.step(record)

    def _step_record(
        self, rep: TrainerReport, trajs: list[Trajectory], trainer_version: int, now: float
    ) -> StepRecord:
        m = rep.metrics
        timing = self.util.snapshot(now + self.t0)
        cpu = time.process_time()
        timing.update(
            train_s=rep.span[1] - rep.span[0],
            weight_sync_s=m.pop("weight_sync_s", 0.0),
            trainer_step_s=m.pop("time_s", 0.0),
            driver_cpu_s=cpu - self._cpu_mark,
        )
        self._cpu_mark = cpu
        self._last_wall = timing["wall_s"]
        return step_record(
            rep.step, self.sched.done_version, trajs, trainer_version, self.sched.ledger_record(),
            self.ses.guard.errors, m, timing,
        )  # fmt: skip

    def _load_final(self) -> None:
        v = self.sched.done_version
        for i, conn in enumerate(self.engine_conns):
            if v not in self.sched.engines[i].loaded:
                conn.send(LoadWeights(i, v))
                while v not in self.sched.engines[i].loaded:
                    self._receive(conn)

    def _check_alive(self) -> None:
        for name, p in [("trainer", self.trainer)] + [
            (f"engine{i}", p) for i, p in enumerate(self.engine_procs)
        ]:
            if not p.is_alive():
                raise RuntimeError(
                    f"{name} process died (exit code {p.exitcode}); the run directory keeps "
                    f"everything up to now — fix the cause and continue with --resume"
                )


def _tensorboard(run: RunDir):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from tailrace.common import ConfigError

        raise ConfigError(
            "tensorboard=true needs the tensorboard package; pip install 'tailrace[tensorboard]' "
            "or drop --tensorboard"
        ) from None
    return SummaryWriter(str(run.path / "tensorboard"))


def _flatten(d: dict, prefix: str = ""):
    """('length/p50', 37.0)... for every numeric leaf of a step record."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
            yield prefix + k, v


def _expect_ready(conn, proc, name: str, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if conn.poll(0.5) and isinstance(conn.recv(), Ready):
            return
        if not proc.is_alive():
            raise RuntimeError(
                f"{name} process failed to start (exit code {proc.exitcode}); see the error above"
            )
    raise RuntimeError(f"{name} process did not become ready within {timeout:.0f}s")
