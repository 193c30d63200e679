"""The local driver: scheduler in this process, trainer and engines in their own pinned processes.

    poll the scheduler -> send its commands -> wait for reports -> feed them back -> log

Engines report finished results in batches; the driver scores them (RewardGuard: timeouts, never
crashes the run), turns them into Trajectories and hands them to the scheduler. The trainer reports
each finished step (durable when a checkpoint was asked for). Everything the run produces is
appended to the run directory as it happens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

from tailrace.config import RunConfig
from tailrace.flow import resume
from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Train
from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.jsonlines import read_lines
from tailrace.runtime.engine_worker import EngineReport, EngineSpec, engine_main
from tailrace.runtime.evaluate import Evaluator
from tailrace.runtime.metrics import Utilization, length_stats, staleness_hist
from tailrace.runtime.procs import context, placement
from tailrace.runtime.rundir import JsonLines, RunDir, truncate_lines
from tailrace.runtime.session import Session
from tailrace.runtime.trainer_worker import TrainerReport, TrainerSpec, TrainOrder, trainer_main
from tailrace.runtime.weights import SharedWeights
from tailrace.types import Trajectory


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
        f = cfg.flow
        spec = FlowSpec(f.prompts_per_round, f.samples_per_prompt, f.groups_per_step, f.steps)
        policy = make_policy(
            f.mode, max_staleness=f.max_staleness, frontier=f.frontier, rollout_groups=f.rollout_groups
        )
        engines = [(cfg.rollout.slots, cfg.rollout.lookahead)] * cfg.rollout.engines
        self.sched = Scheduler(policy, session.prompt_stream(), engines, spec)
        self.metrics = JsonLines(run.file("metrics.jsonl"))
        self.events = JsonLines(run.file("events.jsonl"))
        self.journal = JsonLines(run.file("journal.jsonl"))
        self.tb = _tensorboard(run) if cfg.tensorboard else None
        self.pending_trajs: dict[int, tuple[int, list[Trajectory]]] = {}  # step -> (version, trajectories)

    # ------------------------------------------------------------------ set-up
    def _restore(self) -> int:
        """Load the scheduler checkpoint and replay the journal; returns the version to start from."""
        state = json.loads((self.resume_from / "scheduler.json").read_text())
        resume.load_state_dict(self.sched, state)
        entries = list(read_lines(self.run.file("journal.jsonl")))[state["journal_seq"] :]
        resume.replay(self.sched, entries)
        done = state["steps_done"]
        truncate_lines(self.run.file("metrics.jsonl"), lambda r: r.get("kind") != "step" or r["step"] < done)
        self.metrics = JsonLines(self.run.file("metrics.jsonl"))
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
        _expect(self.trainer_conn, "ready", self.trainer, "trainer")
        r = cfg.rollout
        self.engine_conns, self.engine_procs = [], []
        for i, cores in enumerate(engine_cores):
            espec = EngineSpec(
                str(ses.model_path),
                r.slots,
                r.max_new_tokens,
                r.temperature,
                r.top_p,
                r.top_k,
                r.prefill_tokens,
                r.threads,
                cores,
                cfg.seed,
                ses.tok.eos_id,
                cfg.model.dtype,
                start_version=version,
                attention=r.attention,
            )
            conn, child = ctx.Pipe()
            p = ctx.Process(target=engine_main, args=(i, espec, child, self.weights), daemon=True)
            p.start()
            self.engine_conns.append(conn)
            self.engine_procs.append(p)
        for conn, p in zip(self.engine_conns, self.engine_procs):
            _expect(conn, "ready", p, "engine")
        self.t0 = time.perf_counter()
        self.util = Utilization(self.t0, slots=r.slots * r.engines)

    def close(self) -> None:
        for conn in [getattr(self, "trainer_conn", None), *getattr(self, "engine_conns", [])]:
            if conn is not None:
                try:
                    conn.send(None)
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
        evaluator = Evaluator(self.ses, self.engine_conns, self.cfg.eval) if self.cfg.eval.n else None
        base = self._recorded_eval("base")
        if base is None and evaluator is not None:
            base = evaluator.run("base", version, self._on_engine_report)
            self.metrics.write({"kind": "eval", "tag": "base", "step": self.sched.steps_done, **base})
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
            self._execute(self.sched.poll(self._now()))
            self._drain_journal()
            ready = wait([self.trainer_conn, *self.engine_conns], timeout=1.0)
            for conn in ready:
                self._receive(conn)
            self._check_alive()
        self._finish_marks()
        final = None
        if evaluator is not None:
            self._load_final()
            final = evaluator.run("final", self.sched.done_version, self._on_engine_report)
            self.metrics.write({"kind": "eval", "tag": "final", "step": self.sched.steps_done, **final})
        wall = self._now()
        return Summary(
            self.sched.steps_done,
            wall,
            base["accuracy"] if base else None,
            final["accuracy"] if final else None,
            str(self.run.path),
        )

    def _recorded_eval(self, tag: str) -> dict | None:
        for r in read_lines(self.run.file("metrics.jsonl")):
            if r.get("kind") == "eval" and r.get("tag") == tag:
                return r
        return None

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _execute(self, cmds) -> None:
        for c in cmds:
            if isinstance(c, (Generate, Abort, LoadWeights, DropWeights)):
                self.engine_conns[c.engine].send(c)
            elif isinstance(c, Train):
                every = self.cfg.flow.checkpoint_every
                save = None
                if c.publish is not None and (c.step + 1) % every == 0 or c.step + 1 == self.cfg.flow.steps:
                    save = str(self.run.ckpt / f"step_{c.step + 1:06d}")
                self.pending_trajs[c.step] = (
                    c.trainer_version,
                    [t for g in c.groups for t in g.trajectories],
                )
                self.trainer_conn.send(TrainOrder(c, save))

    def _receive(self, conn) -> None:
        msg = conn.recv()
        if isinstance(msg, EngineReport):
            self._on_engine_report(msg)
        elif isinstance(msg, TrainerReport):
            self._on_trainer_report(msg)

    def _on_engine_report(self, rep: EngineReport) -> list:
        """Account an engine report; returns eval results (ids starting with 'eval') to the caller."""
        st = rep.stats
        self.util.slot_time += st.slot_s
        self.util.engine_busy += st.busy_s
        self.util.gen_tokens += st.decode_tokens
        for t0, t1 in st.spans:
            self.events.write(
                {"lane": f"engine{rep.engine}", "phase": "generate", "t0": t0 - self.t0, "t1": t1 - self.t0}
            )
        for v, t0, t1 in rep.loaded:
            self.events.write(
                {
                    "lane": f"engine{rep.engine}",
                    "phase": "sync",
                    "t0": t0 - self.t0,
                    "t1": t1 - self.t0,
                    "version": v,
                }
            )
            self.sched.on_loaded(rep.engine, v, self._now())
        evals = [r for r in rep.results if r.request_id.startswith("eval")]
        mine = [r for r in rep.results if not r.request_id.startswith("eval")]
        if mine:
            trajs = self.ses.score(mine, self.sched.samples)
            self.sched.on_results(rep.engine, trajs, self._now())
        return evals

    def _on_trainer_report(self, rep: TrainerReport) -> None:
        now = self._now()
        t0, t1 = rep.span
        self.util.trainer_busy += t1 - t0
        self.util.train_tokens += int(rep.metrics.get("tokens", 0))
        self.events.write(
            {"lane": "trainer", "phase": "train", "t0": t0 - self.t0, "t1": t1 - self.t0, "step": rep.step}
        )
        if rep.sync_span:
            self.util.sync_time += rep.sync_span[1] - rep.sync_span[0]
            self.events.write(
                {
                    "lane": "trainer",
                    "phase": "sync",
                    "t0": rep.sync_span[0] - self.t0,
                    "t1": rep.sync_span[1] - self.t0,
                    "version": rep.published,
                }
            )
        self.sched.on_trained(rep.step, now)
        if rep.published is not None:
            self.sched.on_published(rep.published, now)
        trainer_version, trajs = self.pending_trajs.pop(rep.step)
        record = self._step_record(rep, trajs, trainer_version, now)
        if rep.saved:
            self._drain_journal(sync=True)
            (Path(rep.saved) / "scheduler.json").write_text(json.dumps(resume.state_dict(self.sched)))
            self.run.set_latest(Path(rep.saved).name, self.cfg.flow.keep_checkpoints)
        self.metrics.write(record)
        if self.tb is not None:
            for key, value in _flatten(record):
                self.tb.add_scalar(key, value, rep.step + 1)
        if self.ui is not None:
            self.ui.step(record)

    def _step_record(
        self, rep: TrainerReport, trajs: list[Trajectory], trainer_version: int, now: float
    ) -> dict:
        m = rep.metrics
        rewards = [t.reward for t in trajs]
        timing = self.util.snapshot(now + self.t0)
        cpu = time.process_time()
        timing.update(
            train_s=rep.span[1] - rep.span[0],
            weight_sync_s=m.pop("weight_sync_s", 0.0),
            trainer_step_s=m.pop("time_s", 0.0),
            driver_cpu_s=cpu - self._cpu_mark,
        )
        self._cpu_mark = cpu
        return {
            "kind": "step",
            "step": rep.step,
            "version": self.sched.done_version,
            "reward": sum(rewards) / len(rewards),
            "accuracy": sum(t.correct for t in trajs) / len(trajs),
            "samples": len(trajs),
            "length": length_stats(trajs),
            "staleness": staleness_hist(trajs, trainer_version),
            "discards": dict(self.sched.ledger.discarded),
            "ledger": {**self.sched.ledger.state_dict(), "in_store": self.sched.store.in_store()},
            "reward_errors": dict(self.ses.guard.errors),
            "train": {k: v for k, v in m.items() if isinstance(v, (int, float))},
            "time": timing,
        }

    def _drain_journal(self, sync: bool = False) -> None:
        for e in self.sched.journal:
            self.journal.write(e)
        self.sched.journal.clear()
        if sync:
            self.journal.sync()
        for m in self.sched.marks:
            self.events.write({"lane": "scheduler", "kind": m.kind, "t": m.t, **m.data})
        self.sched.marks.clear()

    def _finish_marks(self) -> None:
        self._drain_journal(sync=True)

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
        from tailrace.errors import ConfigError

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


def _expect(conn, what: str, proc, name: str, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if conn.poll(0.5):
            msg = conn.recv()
            if isinstance(msg, tuple) and msg[0] == what:
                return
        if not proc.is_alive():
            raise RuntimeError(
                f"{name} process failed to start (exit code {proc.exitcode}); see the error above"
            )
    raise RuntimeError(f"{name} process did not become ready within {timeout:.0f}s")
