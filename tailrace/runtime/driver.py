"""The driver: scheduler in this process, trainer and engines in processes of their own — pinned to
this machine's cores, or Ray actors on a cluster (`runtime.kind`; runtime/hosts.py says where).

    poll the scheduler -> execute its commands, record its journal and marks -> wait for reports
    -> score engine results and feed them back -> log

Engines report finished results in batches; the driver scores them (RewardGuard: timeouts, never
crashes the run) and hands results and scores to the scheduler, which builds the trajectories. In a
multi-turn task a result that stopped at a tool call is not scored: the scheduler parks it, the tool
runs in the driver's pool (runtime/tools.py), and its observation goes back to the scheduler, which
sends the continuation. The
trainer reports each finished step (durable when a checkpoint was asked for). Everything the run
produces is appended to the run directory as it happens.

A worker lost while the run goes is replaced (runtime/recovery.py bounds how often): an engine by one
holding the versions the scheduler says it held, its in-flight samples dispatched again
(`Scheduler.on_engine_lost`); the trainer by one started from the newest whole checkpoint, which
redoes the steps since (runtime/orders.py). The other workers keep going meanwhile. A driver that
dies itself is resumed from the run directory under `tailrace train --supervise`
(runtime/supervisor.py); the resumed one records that recovery once its workers are up.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from tailrace.common import ConfigError, Fault, InputError, one_line
from tailrace.config import RunConfig, TrainerConfig, dump_config
from tailrace.config.load import policy_configs
from tailrace.engine import capabilities
from tailrace.engine.spec import SpecOptions
from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Train
from tailrace.flow.external import is_external
from tailrace.flow.filters import load_keep
from tailrace.flow.multi import PolicySet
from tailrace.flow.policies import make_policy, recommended_mode
from tailrace.flow.replay import ReplayOptions
from tailrace.flow.scheduler import FlowSpec, Outbox, Scheduler
from tailrace.flow.shaping import make_shaping
from tailrace.metrics import step_record
from tailrace.records import CheckpointRecord, EvalRecord, Mark, Span, StepRecord, read_metrics
from tailrace.runtime import checkpoint
from tailrace.runtime.engine_worker import EngineSpec, engine_main
from tailrace.runtime.evaluate import Evaluator, next_turn
from tailrace.runtime.health import Heard, Lost
from tailrace.runtime.hosts import Seat, Started, hosts_for
from tailrace.runtime.join import Arrival, Asked, Desk, Leave, PolicyJoin, Welcome, serve_weights
from tailrace.runtime.messages import EngineReport, Go, History, Ready, TrainerReport, TrainOrder
from tailrace.runtime.metrics import SpecTally, Utilization
from tailrace.runtime.policy_run import PolicyRun
from tailrace.runtime.procs import available_cores
from tailrace.runtime.recovery import Recovery, describe, saved_versions, weights_on_disk
from tailrace.runtime.resume import Resume
from tailrace.runtime.rundir import RecordFile, RunDir
from tailrace.runtime.session import Session
from tailrace.runtime.shared_base import SharedBase
from tailrace.runtime.shared_base import share as share_base
from tailrace.runtime.snapshots import Snapshot, Snapshots
from tailrace.runtime.supervisor import DriverLost
from tailrace.runtime.tools import Failed, ToolPool
from tailrace.runtime.trainer_worker import TrainerSpec, trainer_main
from tailrace.runtime.workers import Worker, Workers
from tailrace.tasks.env import Turn
from tailrace.types import (
    Capabilities,
    Finish,
    GenRequest,
    GenResult,
    Prompt,
    SamplingParams,
    Scored,
    Trajectory,
)


@dataclass
class Summary:
    steps: int
    wall_s: float
    base_accuracy: float | None
    final_accuracy: float | None
    run_dir: str
    # a run of several policies: name -> (base accuracy, final accuracy) of each
    policies: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)


class Driver:
    def __init__(
        self,
        cfg: RunConfig,
        run: RunDir,
        session: Session | list[Session],
        resume: Resume | list[Resume] | None = None,
        ui=None,
        driver_lost: DriverLost | None = None,
    ) -> None:
        """`session`: the run's, or one per policy of `cfg.policies` (in order); `resume` likewise (each
        policy resumes from its own newest checkpoint). `driver_lost`: how the driver this one resumes
        died, under `tailrace train --supervise`."""
        cfg, _ = with_mode(cfg)
        sessions = session if isinstance(session, list) else [session]
        named = policy_configs(cfg)
        if len(named) != len(sessions):
            raise ValueError(f"{len(named)} policies but {len(sessions)} sessions")
        self.cfg, self.run, self.ui = cfg, run, ui
        self.driver_lost = driver_lost if resume is not None else None
        # what the trainers publish (the model's weights, or with train.lora its adapter): one layout
        self.layout = sessions[0].flat_layout()
        self.events = RecordFile(run.file("events.jsonl"))
        self.pols = [self._policy(p, name, with_mode(pc)[0], ses) for p, ((name, pc), ses) in
                     enumerate(zip(named, sessions))]  # fmt: skip
        self.sched = PolicySet(
            [p.name or "main" for p in self.pols],
            [p.sched for p in self.pols],
            cfg.flow.share == "turns",
            room=cfg.max_policies,
        )
        self.hosts = hosts_for(cfg.runtime)
        self.workers = Workers(
            cfg.worker_timeout_s, run.file("errors.log"), recover=cfg.max_restarts > 0, hosts=self.hosts
        )
        self.recovery = Recovery(cfg.max_restarts)
        self.resumes: list[Resume | None] = (
            [None] * len(self.pols) if resume is None else resume if isinstance(resume, list) else [resume]
        )
        for pol, res in zip(self.pols, self.resumes):
            if res is not None:
                pol.restart_from = res.checkpoint  # the newest whole checkpoint
                # the policy's kept checkpoints hold older versions' weights too
                pol.saved_versions = saved_versions(pol.run.ckpt)
        self.tb = _tensorboard(run) if cfg.tensorboard else None
        self._eval_wanted: set[str] = set()  # ids of held-out requests not yet returned
        self._eval_sent: dict[int, tuple[GenRequest, ...]] = {}  # engine -> the held-out requests it got
        self._eval_results: list[GenResult] = []
        self._eval_version: int | None = None  # the engines' version slot for snapshots, after training
        self._eval_loaded: set[int] = set()  # engines that hold the snapshot being evaluated
        r = cfg.rollout
        sp = r.spec
        self.spec = None if sp.drafter == "none" else SpecOptions(
            sp.drafter, sp.toggle, sp.min_speedup, sp.gamma_min, sp.gamma_max, sp.train_s
        )  # fmt: skip
        self.spec_tally = SpecTally()
        # multi-turn tasks (any policy's): one pool runs every policy's tools (task.tool_threads: the run's)
        multi = any(p.ses.env is not None for p in self.pols)
        self.tools = ToolPool(cfg.task.tool_threads) if multi else None
        # multi-turn: the engines' context limit, and each parked sample's room in it for an answer
        self.context = r.max_context or sessions[0].model_cfg.max_position_embeddings
        self._room: dict[str, int] = {}
        self._eval_ses: Session = sessions[0]  # the session of the policy being evaluated
        self._eval_reqs: dict[str, tuple[Prompt, GenRequest]] = {}  # held-out id -> its prompt and request
        self._eval_calls: dict[str, int] = {}  # held-out id -> tool calls answered (multi-turn)
        self.desk: Desk | None = None
        self.endpoint = None  # flow.mode=external: the run's OpenAI-compatible endpoint (serve/attached.py)
        self._resumed_at = 0.0  # a resumed run's clock when this session took it up (its last step record's)
        # several policies' trainers sharing cores (the local runtime's trainer cores; on Ray each has a
        # bundle of its own): with flow.share=turns one trains at a time, its steps in the order they
        # were issued (time-sliced together, two policies that finish their rounds together train
        # together and then generate together: in phase, never in turns); set once they are placed
        self._one_trainer = False
        self._training: PolicyRun | None = None  # the policy whose trainer has a step in hand
        self._waiting_orders: deque[tuple[PolicyRun, TrainOrder]] = deque()

    def _policy(self, p: int, name: str, cfg: RunConfig, ses: Session) -> PolicyRun:
        """Policy `p` of the run: its scheduler on the run's engines, its files (the run directory's
        top for the run's only policy, policies/<name>/ for one of several)."""
        f, r = cfg.flow, cfg.rollout
        spec = FlowSpec(f.prompts_per_round, f.samples_per_prompt, f.groups_per_step, f.steps)
        keep = load_keep(cfg.store.filter) if cfg.store.filter else None
        policy = make_policy(
            f.mode, f.zero_signal, f.extra_groups, keep, cfg.store.filter or "", max_staleness=f.max_staleness,
            frontier=f.frontier,
            rollout_groups=f.rollout_groups, ahead=f.ahead, placement=f.placement,
            pregen_below=r.spec.pregen_below,
        )  # fmt: skip
        train_cfg = with_correction(cfg.train, policy.own_correction(f.steps_per_round, cfg.store.replay > 0))
        sampling = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=ses.stop_ids,
        )
        engines = [(r.slots, r.lookahead)] * r.engines
        shaping = make_shaping(cfg.shaping.name, window=f.prompts_per_round, **cfg.shaping.options())
        sched = Scheduler(
            policy, ses.prompt_stream(), engines, spec, sampling, seed=cfg.seed, shaping=shaping,
            capabilities=run_capabilities(cfg),
            replay=ReplayOptions(**cfg.store.options()),
        )  # fmt: skip
        run = self.run
        if name:  # its own directory, as a run's: report, eval and --model.path read it as they read a run
            run = RunDir(self.run.path / "policies" / name)
            run.ckpt.mkdir(parents=True, exist_ok=True)
            run.file("config.yaml").write_text(dump_config(cfg))
        # fp32 weights and AdamW's two moments (a LoRA run's: its adapter's): what a checkpoint weighs
        cadence = checkpoint.Cadence.of(
            f.checkpoint_every, f.checkpoint_minutes, 12 * self.layout.buffer.numel()
        )
        snapshots = Snapshots(run.path, cfg.eval.every if cfg.eval.n else 0)
        marks = RecordFile(run.file("events.jsonl")) if name else None
        return PolicyRun(name, p, cfg, sched, ses, train_cfg, run, cadence, snapshots, marks=marks)

    # ------------------------------------------------------------------ set-up
    def _older_weights(self, pol: PolicyRun, version: int) -> dict[int, Path]:
        """On resume: the older versions `pol`'s restored groups' pending samples need (multiversion),
        from its kept checkpoints holding them, by engine version (version 0 of the first policy: the
        model the engines load, kept); a group whose version no checkpoint holds starts over under
        `version`, its finished samples discarded (said in a mark and the console); so does every such
        group on engines that hold one version at a time."""
        sched = pol.sched
        need = sched.pending_versions() - {version}
        if sched.capabilities.versions_at_once == 1:  # the engines hold the resumed version only
            disk, missing, why = {}, sorted(need), "the engines hold one version at a time"
        else:
            disk, missing = weights_on_disk(sorted(need), lambda v: False, pol.saved_versions)
            why = "in no kept checkpoint"
            if 0 in need and self.sched.version(pol.index, 0) != 0:  # not the engines' own model
                missing.append(0)
        if missing:
            n = sched.restart_groups(set(missing), version)
            if self.ui is not None:
                self.ui.note(f"resumed: the weights of version(s) {missing}: {why}; "
                             f"{n} group(s) of them start over under version {version}")  # fmt: skip
        # version 0 of the first policy is the model the engines load: they keep it as well
        for v in [*disk, *([0] if 0 in need and 0 not in missing else [])]:
            sched.restore_version(v)
        return {self.sched.version(pol.index, v): p / "model" for v, p in disk.items()}

    def _start(self, versions: list[int], older: dict[int, Path] | None = None) -> None:
        """Start the workers: policy p's trainer from `versions[p]` (its checkpoint's on resume), the
        engines holding every policy's start version and the `older` engine versions from disk."""
        cfg, r = self.cfg, self.cfg.rollout
        trainer_seats, engine_seats = self.hosts.place(
            [p.worker_name for p in self.pols], r.engines, r.threads
        )
        shared = _share_cores(trainer_seats)  # several trainers on one machine (not Ray's bundles)
        self._one_trainer = cfg.flow.share == "turns" and shared
        self.device = device = self.hosts.device(cfg.device)
        # each policy's live versions, side by side: policy p's sit in the slots = p (mod S), S the
        # run's room for policies (those that may join included)
        staleness = max(p.cfg.flow.max_staleness for p in self.pols)
        self.weights = self.hosts.ring(self.layout, slots=(staleness + 3) * self.sched.room)
        if self.sched.room > len(self.pols) and self.ui is not None:
            size = self.layout.buffer.numel() * self.layout.buffer.element_size() * self.weights.slots
            self.ui.note(
                f"room for {self.sched.room - len(self.pols)} more policies (max_policies={self.sched.room}): "
                f"{size / 2**20:,.0f} MiB of shared memory for the published weights"
            )
        self._base = self._shared_base(shared, device)
        for pol, seat, res in zip(self.pols, trainer_seats, self.resumes):
            version = self.sched.version(pol.index, versions[pol.index])
            self._start_trainer(pol, seat, version, res, trainers=len(self.pols) if shared else 1)
        self.expected_context = max(
            p.ses.expected_context(max(r.max_new_tokens, p.cfg.eval.max_new_tokens)) for p in self.pols
        )  # the longest request of any policy's
        self.seats = (*trainer_seats, *engine_seats)
        self.especs = {
            i: self._engine_spec(seat, tuple(sorted(self.sched.loaded(i))), older)
            for i, seat in enumerate(engine_seats)
        }
        # The engines start alongside the trainer (their imports overlap its start-up), gated: each
        # loads its weights (from the ring the trainer fills) and sizes its KV memory once it is up.
        self.engines: dict[int, Worker] = {
            i: self.workers.start(f"engine{i}", engine_main, i, replace(e, gated=True), self.weights)
            for i, e in self.especs.items()
        }  # by engine id: engines that joined are added, those that left removed
        self.workers.ready([p.trainer for p in self.pols])  # the start weights are in shared memory
        for engine in self.engines.values():
            self.workers.send(engine, Go())
        self.workers.ready(list(self.engines.values()))
        self.desk = Desk(
            self.run.path, *self.hosts.desk()
        )  # engines may join (tailrace engine join) and leave
        self.t0 = time.perf_counter()
        for p in self.pols:
            p.util = Utilization(self.t0, slots=r.slots * r.engines)

    def _start_trainer(
        self, pol: PolicyRun, seat: Seat, version: int, res: Resume | None, trainers: int
    ) -> None:
        """`pol`'s trainer process, from engine version `version` (its checkpoint's on resume);
        `trainers`: how many share its cores (each sizes its micro-batches from its share)."""
        pol.tspec = TrainerSpec(
            str(pol.ses.model_path), pol.train_cfg, threads=seat.threads, cores=seat.cores,
            seed=pol.cfg.seed, start_version=version, resume_from=str(res.checkpoint) if res else None,
            device=self.device, trainers=trainers,
            # the shared base holds its adapted projections in the dtype the trainers compute in
            base=self._base if pol.train_cfg.bf16 == self._base_bf16 else None,
        )  # fmt: skip
        pol.trainer = self.workers.start(pol.worker_name, trainer_main, pol.tspec, self.weights)

    def _shared_base(self, shared: bool, device: str) -> SharedBase | None:
        """Several LoRA policies' trainers on this machine's CPU: one copy of their frozen base
        (runtime/shared_base.py), said on the console either way."""
        lora_cfg, bf16 = self.cfg.train.lora, {p.train_cfg.bf16 for p in self.pols}
        several = len(self.pols) > 1 or self.sched.room > 1  # (or policies may join)
        self._base_bf16: bool | None = None
        if not (lora_cfg.rank and several and shared and device == "cpu" and len(bf16) == 1):
            return None
        self._base_bf16 = bf16.pop()
        base, why = share_base(self.pols[0].ses.model_path, lora_cfg, self._base_bf16)
        if self.ui is not None:
            self.ui.note(why)
        return base

    def _engine_spec(
        self, seat: Seat, start: tuple[int, ...], older: dict[int, Path] | None = None
    ) -> EngineSpec:
        """`start`: the engine versions it starts with (each policy's start version, and older ones a
        resume restored; on one-version engines its owner's only); `older`: the checkpoint model
        directories of those the ring does not hold."""
        r, older = self.cfg.rollout, older or {}
        return EngineSpec(  # its model: the first policy's start weights, engine version 0
            str(self.pols[0].ses.model_path), r.slots, r.prefill_tokens, seat.threads, seat.cores, self.cfg.seed,
            self.cfg.model.dtype,
            start_versions=start,
            from_disk=tuple((v, str(p)) for v, p in sorted(older.items()) if v in start),
            attention=r.attention, max_context=r.max_context,
            kv_memory_gb=r.kv_memory_gb, expected_context=self.expected_context, device=self.device, spec=self.spec,
            backend=r.backend, keep_finished=r.keep_kv and self.tools is not None and self.spec is None,
            max_versions=r.max_versions,
            lora_alpha=self.cfg.train.lora.alpha if self.cfg.train.lora.rank else None,
            lora_init=self.cfg.train.lora.init, lora_rank=self.cfg.train.lora.rank,
            max_adapters=self.weights.slots - self.sched.room,  # each policy's max_staleness + 2 versions
        )  # fmt: skip

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
        if self.tools is not None:
            self.tools.close()
        if self.desk is not None:
            self.desk.close()
        self.workers.close()
        self.hosts.close()
        self.events.close()
        for p in self.pols:
            p.close()
        if self.tb is not None:
            self.tb.close()

    # ------------------------------------------------------------------ the loop
    def train(self) -> Summary:
        versions = [0] * len(self.pols)
        older: dict[int, Path] = {}
        for pol, res in zip(self.pols, self.resumes):
            if res is not None:
                res.restore(pol.sched)
                versions[pol.index] = res.version
                older |= self._older_weights(pol, res.version)
        self.endpoint = self._attach()  # first: a port in use fails the run before anything starts
        self._start(versions, older)
        if self.driver_lost is not None:  # resumed by the supervisor: the driver's own recovery
            self._note(self.driver_lost.mark(self._now(), sum(p.sched.steps_done for p in self.pols)))
        for p in self.pols:
            p.cadence.saved(p.sched.steps_done, 0.0)
        for p in self.pols:
            p.evaluator = Evaluator(p.ses, p.cfg.eval) if p.cfg.eval.n else None
            p.base = self._recorded_eval(p, "base")
            if p.base is None and p.evaluator is not None:
                v = self.sched.version(p.index, versions[p.index])
                self._load_everywhere(v)  # (one-version engines hold their own policy's only)
                p.base = self._evaluate(p, p.evaluator, "base", v, wall_s=0.0)
            p.snapshots = Snapshots(p.run.path, p.snapshots.every, p.sched.steps_done)
        bases = [p.base for p in self.pols]
        # utilization counts from here: the base evaluation is not part of the training timeline; a
        # resumed policy's clock and ratios go on from its last step record
        for p in self.pols:
            f = p.run.file("metrics.jsonl")
            steps = [r for r in read_metrics(f) if isinstance(r, StepRecord)] if f.is_file() else []
            last = steps[-1].time if steps else None
            p.util = Utilization.resumed(time.perf_counter(), p.util.slots, last)
            p.last_wall = last["wall_s"] if last else 0.0
            p.cpu_mark = time.process_time()
        self._resumed_at = max(p.last_wall for p in self.pols)
        if self.ui is not None:
            steps = sum(p.sched.spec.total_steps for p in self.pols)
            self.ui.begin(
                sum(p.sched.steps_done for p in self.pols), steps, bases[0] if len(bases) == 1 else None
            )
            for p, base in zip(self.pols, bases):
                if len(bases) > 1 and base is not None:
                    self.ui.note(
                        f"{p.name}: base policy held-out accuracy {base.accuracy:.1%} on {base.summary['n']} prompts"
                    )
        agent = self.sched if self.endpoint else None  # every policy's scheduler, by the request's model
        while not self.sched.done:
            if agent is not None:  # what the agent sent (requests, groups) goes to the scheduler
                self.endpoint.loop.intake(agent)
            self._handle(self.sched.poll(self._now()))
            self._pump(timeout=1.0 if agent is None else 0.02)
            if agent is not None:
                self.endpoint.loop.answer(agent)
            self._arrivals()
        self._handle(self.sched.poll(self._now()), sync=True)
        finals = [None] * len(self.pols)  # (policies that joined included)
        for k, p in enumerate(self.pols):
            finals[k] = self._recorded_eval(p, "final")  # a policy of several that finished before a resume
            if p.evaluator is not None and finals[k] is None:
                final_v = self.sched.version(p.index, p.sched.done_version)
                self._load_everywhere(final_v)
                finals[k] = self._evaluate(p, p.evaluator, "final", final_v, p.last_wall)
                self._evaluate_snapshots(p, p.evaluator)
        while self.recovery.restarting:  # a worker lost after training: its recovery is recorded too
            self._pump()
        return Summary(
            sum(p.sched.steps_done for p in self.pols),
            self._now() + self._resumed_at,  # a resumed run's: this session on top of its clock before
            self.pols[0].base.accuracy if self.pols[0].base else None,
            finals[0].accuracy if finals[0] else None,
            str(self.run.path),
            {p.name: (p.base.accuracy if p.base else None, f.accuracy if f else None)
             for p, f in zip(self.pols, finals) if p.name},
        )  # fmt: skip

    def _attach(self):
        """flow.mode=external (any policy's): the run's OpenAI-compatible endpoint, for the agent that
        makes that policy's groups (a request's `model` names the policy, in a run of several); None
        for a run whose policies all make their own."""
        if not any(p.sched.policy.external for p in self.pols):
            return None
        pol = self.pols[0]  # the model and its text side are the run's
        from tailrace.serve.attached import Attached  # (serve imports the runtime: not at the top)

        r = self.cfg.rollout
        sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        name = str(self.cfg.model.path or "tailrace-default")
        try:
            a = Attached(
                self.cfg,
                pol.ses.text,
                name,
                self.context,
                sampling,
                self.run.path,
                self.sched.names,
                texts={p.name: p.ses.text for p in self.pols},  # each policy's chat template, system prompt
            )
        except OSError as e:
            s = self.cfg.serve
            raise ConfigError(
                f"serve.host={s.host} serve.port={s.port}: the agent endpoint cannot listen there ({e.strerror}); "
                "pick another serve.port (0: any free one, named in RUN/endpoint.json)"
            ) from None
        if self.ui is not None:
            self.ui.note(f"agent endpoint: {a.url} (completions, chat completions; POST {a.url}/groups sends "
                         f"a scored group back; {a.file} names it)")  # fmt: skip
            if a.generated_token:
                self.ui.note(f"agent endpoint token (this run only): {a.token}")
            if a.exposed:
                self.ui.note(f"warning: the agent endpoint listens on {self.cfg.serve.host}: reachable from "
                             "other machines; anyone with the token can generate and send groups")  # fmt: skip
        return a

    def _recorded_eval(self, pol: PolicyRun, tag: str) -> EvalRecord | None:
        records = read_metrics(pol.run.file("metrics.jsonl"))
        return next((r for r in records if isinstance(r, EvalRecord) and r.tag == tag), None)

    def _evaluate(
        self,
        pol: PolicyRun,
        evaluator: Evaluator,
        tag: str,
        version: int,
        wall_s: float,
        snap: Snapshot | None = None,
    ) -> EvalRecord:
        """`pol`'s held-out requests through the engines' command path; the schedulers are idle
        meanwhile. `version`: the engines' (the policy's own, for one policy). `wall_s`: when it was
        published, on the step records' clock. A snapshot's record carries its own step and version
        (the engines hold it as `version`)."""
        reqs = evaluator.requests(version)
        self._eval_ses = pol.ses
        self._eval_wanted = {r.id for r in reqs}
        self._eval_reqs = {r.id: (p, r) for p, r in zip(evaluator.prompts, reqs)}
        self._eval_calls = {}
        ids = list(self.engines)
        self._eval_sent = {e: tuple(reqs[k :: len(ids)]) for k, e in enumerate(ids)}
        for i, engine in self.engines.items():
            self.workers.send(engine, Generate(i, self._eval_sent[i]))
        while self._eval_wanted:
            self._pump(timeout=5.0)  # all workers: a trainer replaced meanwhile says Ready here
            if self.ui is not None:
                self.ui.evaluating(tag, len(reqs) - len(self._eval_wanted), len(reqs))
        results, self._eval_results, self._eval_sent = self._eval_results, [], {}
        own = self.sched.policy_version(version)[1]
        step, version = (snap.step, snap.version) if snap else (pol.sched.steps_done, own)
        summary = evaluator.summarize(reqs, results)
        if pol.ses.env is not None:  # a multi-turn task: the tool calls its held-out episodes made
            summary["tool_calls"] = sum(self._eval_calls.values())
        rec = EvalRecord(tag, step, summary, version, wall_s)
        pol.metrics.write(rec)
        return rec

    def _evaluate_snapshots(self, pol: PolicyRun, evaluator: Evaluator) -> None:
        """Evaluate the weights `eval.every` kept while training (oldest first), each loaded into one
        spare version of the engines (the policy's next, in the engines' space): the run's clock and
        samples are those of a run without them."""
        done = {r.version for r in read_metrics(pol.run.file("metrics.jsonl")) if isinstance(r, EvalRecord)}
        final = pol.sched.done_version
        ring = self.weights.slots
        spare = self.sched.version(pol.index, final + 1)
        self._eval_version = (
            spare if spare % ring != self.sched.version(pol.index, final) % ring else spare + self.sched.room
        )
        for snap in pol.snapshots.pending(done):
            if snap.version != final:
                self._evaluate_snapshot(pol, evaluator, snap)

    def _evaluate_snapshot(self, pol: PolicyRun, evaluator: Evaluator, snap: Snapshot) -> None:
        v = self._eval_version
        self.weights.write(v, Snapshots.load(snap))
        self._eval_loaded = set()
        for i, engine in self.engines.items():
            self.workers.send(engine, LoadWeights(i, v))
        while len(self._eval_loaded) < len(self.engines):
            self._pump()
        self._evaluate(pol, evaluator, "periodic", v, snap.wall_s, snap)

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _handle(self, outs: list[Outbox], sync: bool = False) -> None:
        """Append each policy's poll records (the journal first: it is the write-ahead log), then
        execute its commands."""
        for pol, out in zip(self.pols, outs):
            self._record(pol, out, sync)
            for c in out.commands:
                if isinstance(c, (Generate, Abort, LoadWeights, DropWeights)):
                    if c.engine in self.engines:  # (none is ever addressed to an engine that left)
                        self.workers.send(self.engines[c.engine], c)
                elif isinstance(c, Train):
                    self._send_train(pol, c)

    def _record(self, pol: PolicyRun, out: Outbox, sync: bool = False) -> None:
        for e in out.journal:
            pol.journal.write(e)
        if sync:
            pol.journal.sync()
        for m in out.marks:
            (pol.marks or self.events).write(m)

    def _send_train(self, pol: PolicyRun, c: Train) -> None:
        steps, now = c.step + 1, self._now()
        save = None
        limit = self.cfg.flow.time_limit_s
        # the first step issued past the limit is the last, kept; so is a leaving policy's next step
        if pol.leaving or (limit is not None and now > limit):
            pol.sched.stop()
        last = steps == pol.sched.spec.total_steps
        if (c.publish is not None and pol.cadence.due(steps, now)) or last:
            save = f"{checkpoint.step_dir(pol.run.ckpt, steps)}.tmp"  # renamed when whole
            pol.cadence.saved(steps, now)
        pol.pending_trajs[c.step] = (c.trainer_version, [t for g in c.groups for t in g.trajectories])
        if c.publish is not None:  # the trainer publishes into the engines' space
            c = replace(c, publish=self.sched.version(pol.index, c.publish))
        # a LoRA run's checkpoints hold the adapter (MBs); the last one the merged model too
        order = pol.orders.add(TrainOrder(c, save, merged=last or not self.cfg.train.lora.rank))
        if order is not None:
            self._order(pol, order)

    def _order(self, pol: PolicyRun, order: TrainOrder) -> None:
        """Hand `order` to its policy's trainer, or queue it while another policy's trainer works on the
        shared cores (flow.share=turns)."""
        if self._one_trainer and self._training is not None:
            self._waiting_orders.append((pol, order))
            return
        self._send_order(pol, order)

    def _send_order(self, pol: PolicyRun, order: TrainOrder) -> None:
        if self._one_trainer:
            self._training = pol
        self.workers.send(pol.trainer, order)

    def _trained(self, pol: PolicyRun) -> None:
        """`pol`'s trainer finished a step: the next order waiting for the cores goes."""
        if self._training is pol:
            self._training = None
            if self._waiting_orders:
                self._send_order(*self._waiting_orders.popleft())

    def _pump(self, among: list[Worker] | None = None, timeout: float = 1.0) -> None:
        """Handle what the workers (`among`, default all) report within `timeout`; a lost worker is
        replaced (or raises, past its restarts)."""
        wake = (self.tools.waitable,) if self.tools is not None else ()
        wake += (self.desk.waitable,) if self.desk is not None else ()
        for w, msg in self.workers.receive(among, timeout, wake):
            self._dispatch(w, msg)
        if self.tools is not None:
            self._on_tools()

    def _dispatch(self, w: Worker, msg) -> None:
        if isinstance(msg, EngineReport):
            self._on_engine_report(msg)
        elif isinstance(msg, TrainerReport):
            self._on_trainer_report(self._trainer_of(w), msg)
        elif isinstance(msg, Lost):
            self._replace(w, msg)
        elif isinstance(msg, Ready):
            self._on_ready(w)

    def _await_ready(self, joiner: Worker) -> None:
        """Until a joining policy's trainer says `Ready`, what the others report handled as `_pump`
        does; the joiner lost or failed while it starts raises `_JoinerLost` (the others' faults go on
        as they would)."""
        while True:
            try:
                got = self.workers.receive(None, timeout=1.0)
            except (Fault, InputError) as e:
                if joiner.lost or str(e).startswith(f"{joiner.name}:"):
                    raise _JoinerLost(one_line(e)) from None
                raise
            for w, msg in got:
                if w is joiner:
                    if isinstance(msg, Lost):
                        raise _JoinerLost(msg.line)
                    if isinstance(msg, Ready):
                        return
                else:
                    self._dispatch(w, msg)

    def _trainer_of(self, w: Worker) -> PolicyRun | None:
        return next((p for p in self.pols if p.trainer is w), None)

    # ------------------------------------------------------------------ tools (multi-turn tasks)
    def _on_tools(self) -> None:
        """Tool calls answered since the last pump: each observation goes to its parked sample."""
        for done in self.tools.take():
            turn, pol = done.value, self.pols[self.sched.policy_of(done.key)]
            if isinstance(turn, Failed):  # the environment itself raised: the policy is told so
                turn = Turn(pol.ses.env.observe(f"error: {turn.error}"), error=True)
            pol.tool_errors += turn.error
            self.events.write(Span("tools", "tool", done.t0 - self.t0, done.t1 - self.t0))
            obs = pol.ses.observation_ids(turn)[: self._room.pop(done.key)]  # within the context limit
            self.sched.on_observation(done.key, obs, self._now())

    def _park_calls(self, results: list[GenResult]) -> set[str]:
        """The results whose turn ended in a tool call their policy's environment answers: their calls
        go to the pool (the sample parks in its scheduler meanwhile). Returns their request ids."""
        if self.tools is None:
            return set()
        calls = set()
        for r in results:
            ses = self.pols[self.sched.policy_of(r.request_id)].ses
            if ses.env is None:  # a single-turn policy's
                continue
            n, p = self.sched.calls_of(r.request_id), self.sched.prompt_of(r.request_id)
            room = self.context - len(p.token_ids) - len(r.token_ids) - 1  # the continuation's 1 token
            # a call on the last token of the budget or of the context has no room for an answer:
            # scored as it stands
            if len(r.token_ids) < self.cfg.rollout.max_new_tokens and room >= 0 and ses.is_call(r, n):
                calls.add(r.request_id)
                self._room[r.request_id] = room
                self.tools.submit(r.request_id, partial(ses.turn, p, r, n))
        return calls

    def _continue_heldout(self, engine: int, r: GenResult) -> bool:
        """A held-out episode's turn that ended in a tool call: answered here, at once (the scheduler is
        idle during evaluation), and continued on the same engine, by the evaluated policy's environment.
        False: the result is final."""
        if self._eval_ses.env is None:
            return False
        n = self._eval_calls.get(r.request_id, 0)
        p, req = self._eval_reqs[r.request_id]
        cont = next_turn(self._eval_ses, p, req, r, n, self.context)
        if cont is None:
            return False
        self._eval_calls[r.request_id] = n + 1
        self._eval_reqs[r.request_id] = (p, cont)
        self.workers.send(self.engines[engine], Generate(engine, (cont,)))
        return True

    # ------------------------------------------------------------------ recovery
    def _replace(self, w: Worker, lost: Lost) -> None:
        now = self._now()
        if w.elastic:  # a joined engine is not the driver's to restart: it leaves, its samples requeued
            self._leave(next(k for k, x in self.engines.items() if x is w), lost.line)
            return
        if not self.recovery.allows(lost, now):
            raise Fault(self.recovery.refusal(lost))
        pol = self._trainer_of(w)
        if pol is not None:
            start = str(pol.restart_from) if pol.restart_from else None  # None: the run's start
            spec = replace(pol.tspec, resume_from=start, publish_start=False)
            pol.trainer = self.workers.replace(w, trainer_main, spec, self.weights)
            self.recovery.begin(lost, now, replayed=pol.orders.restart(pol.sched.steps_done))
            # its orders waiting for the shared cores go to the replacement with the rest, once: drawn
            # from the queue too, they would be trained twice
            self._waiting_orders = deque((q, o) for q, o in self._waiting_orders if q is not pol)
            return
        i = next(k for k, x in self.engines.items() if x is w)
        loading = self.sched.loading(i)  # asked of the lost process: its replacement starts with them
        requeued = self.sched.on_engine_lost(i, now)
        for v in sorted(loading):
            self.sched.on_loaded(i, v, now)
        spec = replace(self.especs[i], **self._engine_weights(i, lost))
        self.engines[i] = self.workers.replace(w, engine_main, i, spec, self.weights)
        self.recovery.begin(lost, now, requeued=requeued)
        wanted = tuple(r for r in self._eval_sent.get(i, ()) if r.id in self._eval_wanted)
        if wanted:  # held-out requests it had: the replacement answers them (episodes from their start)
            for r in wanted:
                self._eval_calls.pop(r.id, None)
            self.workers.send(self.engines[i], Generate(i, wanted))

    def _engine_weights(self, i: int, lost: Lost) -> dict:
        """The versions a replacement for engine i starts with, and the checkpoints of those the ring
        no longer holds."""
        versions = sorted(self.sched.loaded(i))
        saved = {
            self.sched.version(p.index, v): path for p in self.pols for v, path in p.saved_versions.items()
        }
        disk, missing = weights_on_disk(versions, self.weights.holds, saved)
        if missing:
            raise Fault(
                f"{lost.line}, and the weights of version(s) {missing} it held are neither in shared "
                "memory nor in a kept checkpoint (raise flow.keep_checkpoints)"
            )
        return dict(
            start_versions=tuple(versions), from_disk=tuple((v, str(p / "model")) for v, p in disk.items())
        )

    # ------------------------------------------------------------------ engines joining and leaving
    def _arrivals(self) -> None:
        """Engines that asked to join or leave since the last poll (runtime/join.py)."""
        if self.desk is None:
            return
        for what in self.desk.take():
            if isinstance(what, Leave):
                self._leave(what.engine, "asked to leave")
            elif isinstance(what, Asked):
                self._policy_asked(what)
            else:
                self._join(what)

    def _join(self, a: Arrival) -> None:
        r = self.cfg.rollout
        eid = self.sched.add_engine(r.slots, r.lookahead, started=False)  # orders once it is Ready
        cores = a.cores if a.actor else a.cores or self._join_cores()  # a Ray actor: Ray placed it
        spec = self._engine_spec(Seat(cores, r.threads), ())
        started = Started(self.hosts.joined(a), a.conns["messages"], Heard(a.conns["beats"]))
        w = self.workers.adopt(f"engine{eid}", started, elastic=True)
        self.workers.send(w, Welcome(eid, spec, self.layout.layout, self.layout.buffer.dtype))
        serve_weights(a.conns["weights"], self.weights)
        self.engines[eid], self.especs[eid] = w, spec
        data = {
            "engine": eid,
            "pid": a.pid,
            "cores": list(spec.cores),
            **({"actor": a.actor} if a.actor else {}),
        }
        where = f"Ray actor {a.actor}" if a.actor else f"pid {a.pid}"
        self._event(Mark(self._now(), "engine_join", data), f"engine {eid} joined ({where})")

    def _leave(self, eid: int, why: str) -> None:
        """Engine `eid` leaves the run: its samples are requeued, its process told to shut down."""
        if eid not in self.engines:
            self._event(
                Mark(self._now(), "engine_leave_refused", {"engine": eid}), f"engine {eid}: not in the run"
            )
            return
        up = eid not in self.sched.starting
        requeued = self.sched.remove_engine(eid, self._now())
        self.workers.retire(self.engines.pop(eid))
        for p in self.pols:
            p.util.slots -= self.cfg.rollout.slots * up
        wanted = tuple(r for r in self._eval_sent.pop(eid, ()) if r.id in self._eval_wanted)
        if wanted and self.engines:  # (a joined engine died during an evaluation) another answers them
            other = next(iter(self.engines))
            for r in wanted:
                self._eval_calls.pop(r.id, None)
            self._eval_sent[other] = self._eval_sent.get(other, ()) + wanted
            self.workers.send(self.engines[other], Generate(other, wanted))
        data = {"engine": eid, "requeued": requeued, "why": why}
        self._event(
            Mark(self._now(), "engine_leave", data), f"engine {eid} left ({why}): {requeued} samples requeued"
        )

    # ------------------------------------------------------------------ policies joining and leaving
    def _policy_asked(self, asked: Asked) -> None:
        """A policy asked to join the run or to leave it (tailrace policy join / leave): answered with
        one line, what was done or why not; either way in events.jsonl."""
        msg = asked.msg
        if isinstance(msg, PolicyJoin):
            kind, name, act = "policy_join", msg.entry.get("name"), partial(self._add_policy, msg.entry)
        else:
            kind, name, act = "policy_leave", msg.name, partial(self._stop_policy, msg.name)
        try:
            line = act()
        except (ConfigError, InputError, ValueError, KeyError) as e:
            line = one_line(e)
            self._event(Mark(self._now(), f"{kind}_refused", {"policy": name, "why": line}), line)
            asked.answer(False, line)
            return
        data = {"policy": name}
        if kind == "policy_join":  # its step and eval records' clock starts here on the run's (the
            # first policy's: its step records' wall_s, which a resume carries on)
            data["clock_s"] = self.pols[-1].util.start - self.pols[0].util.start
        self._event(Mark(self._now(), kind, data), line)
        asked.answer(True, line)

    def _add_policy(self, entry: dict) -> str:
        """A policy joins the running run: its scheduler on the live engines, its trainer (on the first
        policy's cores, its frozen base shared where the others share theirs; on Ray an actor in a
        bundle of its own), its files under
        policies/<name>/, its base evaluation, and its entry in config.yaml (a resume brings it back)."""
        joined = replace(self.cfg, policies=[*self.cfg.policies, entry])  # (its names checked by the asker)
        name, pc = policy_configs(joined)[-1]
        pc = with_mode(pc)[0]
        why = self.sched.refusal(name, run_capabilities(pc))
        if why:
            raise ValueError(why)
        held = self.weights.slots // self.sched.room - 3  # each policy's slots of the ring, less 3
        if pc.flow.max_staleness > held:
            raise ConfigError(
                f"policy {name}: flow.max_staleness={pc.flow.max_staleness}, and the run's shared memory "
                f"holds {held} (the largest its policies started with); join with --flow.max_staleness={held}"
            )
        if pc.flow.mode == "external" and self.endpoint is None:
            raise ConfigError(
                f"policy {name}: flow.mode=external needs the agent endpoint, which a run opens when it starts "
                "with an external policy; join with another flow.mode"
            )
        ses = Session(pc)
        if ses.env is not None and self.tools is None:  # the first multi-turn policy: the tool pool
            self.tools = ToolPool(self.cfg.task.tool_threads)
        first = self.pols[0].tspec  # on this machine its seat (Ray: a bundle of its own, reserved now)
        seat = self.hosts.trainer_seat(f"trainer-{name}", Seat(first.cores, first.threads))
        pol = self._policy(len(self.pols), name, pc, ses)
        try:  # it joins the schedulers once its start weights are in the ring
            try:
                self._start_trainer(pol, seat, self.sched.version(pol.index, 0), None, first.trainers)
            except Fault as e:  # (a Ray actor that did not start)
                raise _JoinerLost(one_line(e)) from None
            self._await_ready(pol.trainer)
        except _JoinerLost as e:  # the run goes on as it was
            if pol.trainer is not None:
                self.workers.retire(pol.trainer)
            self.hosts.release_trainer_seat(pol.worker_name)
            pol.close()
            raise InputError(
                f"policy {name}: its trainer did not start ({e}); the run goes on without it"
            ) from None
        self.sched.add(name, pol.sched)
        self.pols.append(pol)
        if self.endpoint is not None:  # an agent's requests may name it
            self.endpoint.add_policy(name, ses.text)
        # on this machine it shares the first policy's cores (flow.share=turns: one trains at a time)
        self._one_trainer |= self.cfg.flow.share == "turns" and bool(set(seat.cores) & set(first.cores))
        pol.util = Utilization(time.perf_counter(), slots=self.pols[0].util.slots)
        pol.cpu_mark = time.process_time()
        pol.cadence.saved(0, self._now())
        self.cfg = joined
        _replace_text(self.run.file("config.yaml"), dump_config(joined))
        pol.evaluator = Evaluator(ses, pc.eval) if pc.eval.n else None
        if pol.evaluator is not None:  # the others' work goes on around it; nothing new is dispatched
            v = self.sched.version(pol.index, 0)
            self._load_everywhere(v)
            pol.base = self._evaluate(pol, pol.evaluator, "base", v, wall_s=0.0)
        base = f"; base held-out accuracy {pol.base.accuracy:.1%}" if pol.base else ""
        need = ses.expected_context(max(self.cfg.rollout.max_new_tokens, pc.eval.max_new_tokens))
        kv = (
            f"; note: its requests hold up to {need:,} tokens, and the engines' KV memory was sized for "
            f"{self.expected_context:,} a slot when the run started, so they queue or preempt sooner (a run "
            "started with this policy sizes it)"
            if need > self.expected_context
            else ""
        )
        return (
            f"policy {name} joined as policy {pol.index + 1} of {self.sched.room} ({pc.flow.mode}, "
            f"{pc.flow.steps} steps, task {pc.task.name}){base}; its files: {pol.run.path}{kv}"
        )

    def _stop_policy(self, name: str) -> str:
        """A policy leaves: its next step is its last (checkpointed), its final evaluation comes when the
        run's other policies are done."""
        pol = next(
            (p for p in self.pols if self.sched.names[p.index] == name), None
        )  # ("main": a run's only)
        if pol is None:
            raise InputError(
                f"policy {name!r} is not in the run; its policies: {', '.join(self.sched.names)}"
            )
        if pol.sched.done:
            return f"policy {name} has trained its {pol.sched.steps_done} steps already"
        pol.leaving = True
        return f"policy {name} leaves after its next step (step {pol.sched.steps_issued + 1}, checkpointed)"

    def _event(self, mark: Mark, line: str) -> None:
        self.events.write(mark)
        if self.ui is not None:
            self.ui.note(line)

    def _join_cores(self) -> tuple[int, ...]:
        """A core no worker is pinned to, if there is one; else the first engine's (a joined engine
        shares the rollout pool's cores, never the trainer's unless they are all there is)."""
        used = {c for s in self.seats for c in s.cores} | {c for e in self.especs.values() for c in e.cores}
        free = [c for c in available_cores() if c not in used]
        return (free[0],) if free else self.especs[min(self.especs)].cores

    def _on_ready(self, w: Worker) -> None:
        eid = next((e for e, x in self.engines.items() if x is w), None)
        if eid in self.sched.starting:  # an engine that joined is up: from now on it loads and works
            self.sched.engine_started(eid)
            for p in self.pols:
                p.util.slots += self.cfg.rollout.slots
            self._event(Mark(self._now(), "engine_ready", {"engine": eid}), f"engine {eid} is up")
        mark = self.recovery.ready(w.name, self._now())
        if mark is not None:
            self._note(mark)
        pol = self._trainer_of(w)
        if pol is not None:
            for order in pol.orders.ready():
                self.workers.send(w, order)

    def _note(self, recovery: Mark) -> None:
        self.events.write(recovery)
        if self.ui is not None:
            self.ui.note(describe(recovery))

    def _on_engine_report(self, rep: EngineReport) -> None:
        st = rep.stats
        for p in self.pols:  # the shared engines' figures go to every policy's windows
            p.util.slot_time += st.slot_s
            p.util.engine_busy += st.busy_s
            p.util.gen_tokens += st.decode_tokens
        self.spec_tally.add(st.spec, st.spec_versions, st.train)
        self.sched.on_engine_steps(st.steps, st.decode_tokens, st.prefill_tokens, st.busy_s)
        lane = f"engine{rep.engine}"
        for t0, t1 in st.spans:
            self.events.write(Span(lane, "generate", t0 - self.t0, t1 - self.t0))
        for v, t0, t1 in rep.loaded:
            if v == self._eval_version:  # a snapshot to evaluate, after training: not the scheduler's
                self._eval_loaded.add(rep.engine)
                if self.sched.one_version:  # it replaced what the engine held
                    self.sched.on_replaced(rep.engine)
                continue
            self.events.write(Span(lane, "sync", t0 - self.t0, t1 - self.t0, version=v))
            self.sched.on_loaded(rep.engine, v, self._now())
        for v in rep.missed:
            self.sched.on_load_missed(rep.engine, v, self._now())
        for v, t0, t1 in rep.received:  # a collective's receive, beside the engine's work
            self.events.write(Span(lane, "receive", t0 - self.t0, t1 - self.t0, version=v))
        mine = []
        for r in rep.results:
            if r.request_id in self._eval_wanted:
                if self._continue_heldout(rep.engine, r):
                    continue
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
        ext = [r for r in mine if is_external(self.sched.split(r.request_id)[1])]
        if ext:  # an agent's (flow.mode=external): back to it, unscored (it scores them itself)
            self.sched.on_results(rep.engine, ext, [], self._now())
            mine = [r for r in mine if r not in ext]
        pre = [r for r in mine if self.sched.is_pregen(r.request_id)]
        if pre:  # the next round's prompts, generated in this round's bubble: drafts, not samples
            self.sched.on_results(rep.engine, pre, [], self._now())
            mine = [r for r in mine if not self.sched.is_pregen(r.request_id)]
            done = [d for p in self.pols for d in p.sched.take_pregen()]
            self._relay_history(rep.engine, [p for p, r in done if r.finish != Finish.ABORTED],
                                [r for r in pre if r.finish != Finish.ABORTED])  # fmt: skip
            partial = [(p, r) for p, r in done if r.finish == Finish.ABORTED]  # no engine kept these
            self._relay_history(None, [p for p, _ in partial], [r for _, r in partial])
        if mine:
            calls = self._park_calls([r for r in mine if r.finish == Finish.STOP])
            final = [r for r in mine if r.finish != Finish.ABORTED and r.request_id not in calls]
            prompts = [self.sched.prompt_of(r.request_id) for r in final]
            self._relay_history(rep.engine, prompts, final)
            scores = self._score(prompts, final)
            self.sched.on_results(rep.engine, mine, scores, self._now(), calls=calls)

    def _score(self, prompts: list[Prompt], results: list[GenResult]) -> list[Scored]:
        """Each result scored by its policy's task."""
        if len(self.pols) == 1:
            return self.pols[0].ses.score(prompts, results)
        scores: list[Scored] = []
        for pol in self.pols:
            mine = [k for k, r in enumerate(results) if self.sched.policy_of(r.request_id) == pol.index]
            if mine:
                scores += pol.ses.score([prompts[k] for k in mine], [results[k] for k in mine])
        return scores

    def _relay_history(self, source: int | None, prompts: list[Prompt], results: list[GenResult]) -> None:
        """A drafter's material (a history drafter's lookups, a trained drafter's training data): each
        engine keeps the responses it finishes itself (siblings, earlier epochs); the others get them
        here (every engine, with no source: aborted partials). Drafters of weights ignore them."""
        if self.spec is None or not results:
            return
        if source is not None and len(self.engines) < 2:
            return
        msg = History(tuple((p.token_ids, r.token_ids) for p, r in zip(prompts, results)))
        for i, engine in self.engines.items():
            if i != source:
                self.workers.send(engine, msg)

    def _on_trainer_report(self, pol: PolicyRun, rep: TrainerReport) -> None:
        now = self._now()
        t0, t1 = rep.span
        if not rep.replay:
            self._trained(pol)
        if rep.replay:  # a replacement redoing a step already counted
            self.events.write(Span(pol.worker_name, "replay", t0 - self.t0, t1 - self.t0, step=rep.step))
            return
        pol.util.trainer_busy += t1 - t0  # its own trainer's
        pol.util.train_tokens += int(rep.metrics.get("tokens", 0))
        self.events.write(Span(pol.worker_name, "train", t0 - self.t0, t1 - self.t0, step=rep.step))
        published = None if rep.published is None else self.sched.policy_version(rep.published)[1]
        if rep.sync_span:
            s0, s1 = rep.sync_span
            self.events.write(Span(pol.worker_name, "sync", s0 - self.t0, s1 - self.t0, version=published))
        sched = pol.sched
        sched.on_train_step([t.length for t in pol.pending_trajs[rep.step][1]], t1 - t0)
        sched.on_trained(rep.step, now)
        if published is not None:
            sched.on_published(published, now)
        trainer_version, trajs = pol.pending_trajs.pop(rep.step)
        record = self._step_record(pol, rep, trajs, trainer_version, now)
        pol.metrics.write(record)
        saved = self._checkpoint(pol, rep, published) if rep.saved else None
        if published is not None and pol.snapshots.due(sched.steps_done):
            buf = self.weights.read(rep.published).buffer
            pol.snapshots.take(sched.steps_done, published, record.time["wall_s"], buf)
        if self.tb is not None:
            for key, value in _flatten(record.to_json(), f"{pol.name}/" if pol.name else ""):
                self.tb.add_scalar(key, value, rep.step + 1)
        if self.ui is not None:
            self.ui.step(record, saved, pol.name)

    def _checkpoint(self, pol: PolicyRun, rep: TrainerReport, published: int | None) -> CheckpointRecord:
        """Make the trainer's half-written checkpoint whole: everything it counts is on disk first."""
        self._handle(self.sched.poll(self._now()), sync=True)
        pol.metrics.sync()
        saved = checkpoint.finalize(Path(rep.saved), pol.sched.state_dict(), dump_config(pol.cfg))
        checkpoint.prune(pol.run.ckpt, self.cfg.flow.keep_checkpoints)
        pol.restart_from = saved.path
        pol.orders.checkpointed(rep.step + 1)
        if published is not None:  # its model is that version's weights
            pol.saved_versions[published] = saved.path
        sizes = {"model": saved.model, "optimizer": saved.optimizer, "total": saved.total}
        record = CheckpointRecord(rep.step + 1, sizes, rep.save_s)
        pol.metrics.write(record)
        return record

    def _own_version(self, p: int, g: int) -> int | None:
        """Policy p's version of engine version `g`, None where `g` is another policy's."""
        q, v = self.sched.policy_version(g)
        return v if q == p else None

    def _step_record(
        self, pol: PolicyRun, rep: TrainerReport, trajs: list[Trajectory], trainer_version: int, now: float
    ) -> StepRecord:
        m = rep.metrics
        timing = pol.util.snapshot(now + self.t0)  # since the policy's previous step record
        cpu = time.process_time()
        timing.update(
            train_s=rep.span[1] - rep.span[0],
            weight_sync_s=m.pop("weight_sync_s", 0.0),
            trainer_step_s=m.pop("time_s", 0.0),
            driver_cpu_s=cpu - pol.cpu_mark,
        )
        if self.spec is not None:  # the toggle's choices follow the engines' timings: "time" figures
            # (acceptance by version: the policy's own versions; with several, the rest stay for theirs)
            own = None if not self.sched.translates else partial(self._own_version, pol.index)
            timing.update(self.spec_tally.take(own))
        pol.cpu_mark = cpu
        pol.last_wall = timing["wall_s"]
        tool_errors = None  # a single-turn policy's steps have no tool figures
        if pol.ses.env is not None:
            tool_errors, pol.tool_errors = pol.tool_errors, 0
        return step_record(
            rep.step, pol.sched.done_version, trajs, trainer_version, pol.sched.ledger_record(),
            pol.ses.guard.errors, m, timing, pol.sched.take_generated(), tool_errors,
        )  # fmt: skip

    def _load_everywhere(self, v: int) -> None:
        """Engine version `v` on every engine that lacks it (before a held-out evaluation, the policies
        idle; a one-version engine then holds it alone)."""
        for i in list(self.engines):
            asked = None  # the engine process asked to load v (a replacement is asked again)
            while i in self.engines and v not in self.sched.loaded(i):
                if asked is not self.engines[i]:
                    asked = self.engines[i]
                    self.workers.send(asked, LoadWeights(i, v))
                self._pump()


class _JoinerLost(Exception):
    """A joining policy's trainer died or failed before it was ready."""


def _replace_text(path: Path, text: str) -> None:
    """`path` holds `text`, whole or not at all (a crash mid-write leaves the old file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _share_cores(seats: list[Seat]) -> bool:
    """Whether two of these seats pin to a common core (Ray's seats pin to none: each has its bundle)."""
    return any(set(a.cores) & set(b.cores) for k, a in enumerate(seats) for b in seats[k + 1 :])


def run_capabilities(cfg: RunConfig) -> Capabilities:
    """What the run's engines can do. A LoRA run's versions are adapters over one base
    (`engine.adapter_versions`): as many as the mode needs, whatever `rollout.max_versions`."""
    r = cfg.rollout
    caps = capabilities(r.backend, speculative=r.spec.drafter != "none", max_versions=r.max_versions)
    return replace(caps, versions_at_once=None, adapters=True) if cfg.train.lora.rank else caps


def with_mode(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """`cfg` with the recommended overlap mode where flow.mode is null, and why it is that one (None
    where the config names its mode)."""
    if cfg.flow.mode is not None:
        return cfg, None
    r = cfg.rollout
    mode, why = recommended_mode(
        cfg.shaping.name,
        run_capabilities(cfg).versions_at_once,
        r.spec.pregen_below is not None,
    )
    return replace(cfg, flow=replace(cfg.flow, mode=mode)), why


def with_correction(train: TrainerConfig, own: str) -> TrainerConfig:
    """`train` with the mode's own off-policy correction where train.loss.correction is null."""
    if train.loss.correction is not None:
        return train
    return replace(train, loss=replace(train.loss, correction=own))


def _tensorboard(run: RunDir):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
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
