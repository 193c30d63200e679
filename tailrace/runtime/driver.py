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

This file holds the set-up and the loop; what workers report is handled in runtime/reports.py, workers
replaced, joining and leaving in runtime/membership.py (both mixins of `Driver`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tailrace.common import ConfigError, InputError
from tailrace.config import RunConfig, dump_config
from tailrace.config.load import policy_configs
from tailrace.engine.spec import SpecOptions
from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Train
from tailrace.flow.filters import load_keep
from tailrace.flow.multi import PolicySet
from tailrace.flow.policies import make_policy
from tailrace.flow.replay import ReplayOptions
from tailrace.flow.scheduler import FlowSpec, Outbox, Scheduler
from tailrace.flow.shaping import make_shaping
from tailrace.records import EvalRecord, Mark, StepRecord, on_prompts, read_metrics
from tailrace.runtime import checkpoint
from tailrace.runtime.engine_worker import EngineSpec, engine_main
from tailrace.runtime.evaluate import Evaluator
from tailrace.runtime.health import Lost
from tailrace.runtime.hosts import Seat, hosts_for
from tailrace.runtime.join import Desk
from tailrace.runtime.membership import Membership
from tailrace.runtime.messages import EngineReport, Go, Ready, TrainerReport, TrainOrder
from tailrace.runtime.metrics import SpecTally, Utilization
from tailrace.runtime.policy_run import PolicyRun
from tailrace.runtime.procs import resolve_dtype
from tailrace.runtime.recovery import Recovery, describe, saved_versions, weights_on_disk
from tailrace.runtime.reports import Reports
from tailrace.runtime.resume import Resume
from tailrace.runtime.run_modes import run_capabilities, with_correction, with_mode
from tailrace.runtime.rundir import RecordFile, RunDir
from tailrace.runtime.session import Session
from tailrace.runtime.shared_base import SharedBase
from tailrace.runtime.shared_base import share as share_base
from tailrace.runtime.snapshots import Snapshot, Snapshots
from tailrace.runtime.supervisor import DriverLost
from tailrace.runtime.tools import ToolPool
from tailrace.runtime.trainer_worker import TrainerSpec, trainer_target
from tailrace.runtime.workers import Worker, Workers
from tailrace.types import (
    GenRequest,
    GenResult,
    Prompt,
    SamplingParams,
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


class Driver(Membership, Reports):
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
            cfg.worker_timeout_s,
            run.file("errors.log"),
            recover=cfg.max_restarts > 0,
            hosts=self.hosts,
            explain=self._memory_hint,
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
        self.context = sessions[0].context
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
        # fp32 weights and AdamW's two moments (a LoRA run's: its adapter's; a critic's about as many
        # again): what a checkpoint weighs
        weighs = 12 * self.layout.buffer.numel() * (2 if cfg.train.advantage == "gae" else 1)
        cadence = checkpoint.Cadence.of(f.checkpoint_every, f.checkpoint_minutes, weighs)
        snapshots = Snapshots(run.path, cfg.eval.every if cfg.eval.n else 0)
        marks = RecordFile(run.file("events.jsonl")) if name else None
        return PolicyRun(name, p, cfg, sched, ses, train_cfg, run, cadence, snapshots, marks=marks)

    # ------------------------------------------------------------------ set-up
    def _older_weights(self, pol: PolicyRun, version: int) -> dict[int, Path]:
        """On resume: the older versions `pol`'s restored groups' pending samples need (multiversion),
        from its kept checkpoints holding them, by engine version. Version 0 is the model the run
        started from: the first policy's is the engines' own model, kept; another full-model policy's
        is loaded from the model's path (a LoRA policy's start adapter is in no file). A group whose
        version no checkpoint holds starts over under `version`, its finished samples discarded (said
        in a mark and the console); so does every such group on engines that hold one version at a time."""
        sched = pol.sched
        need = sched.pending_versions() - {version}
        own = self.sched.version(pol.index, 0) == 0  # the engines' own model: kept
        start = not own and not pol.train_cfg.lora.rank  # loaded from the model's path
        model = 0 if own or start else None
        if sched.capabilities.versions_at_once == 1:  # the engines hold the resumed version only
            disk, missing, why, model = {}, sorted(need), "the engines hold one version at a time", None
        else:
            disk, missing = weights_on_disk(sorted(need), lambda v: False, pol.saved_versions, model)
            why = "in no kept checkpoint"
        if missing:
            n = sched.restart_groups(set(missing), version)
            if self.ui is not None:
                self.ui.note(f"resumed: the weights of version(s) {missing}: {why}; "
                             f"{n} group(s) of them start over under version {version}")  # fmt: skip
        for v in [*disk, *({model} & need)]:
            sched.restore_version(v)
        paths = {self.sched.version(pol.index, v): p / "model" for v, p in disk.items()}
        if start and model == 0 and 0 in need:
            paths[self.sched.version(pol.index, 0)] = Path(pol.ses.model_path)
        return paths

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
        self.dtype = resolve_dtype(cfg.model.dtype, device)  # the engines' (one for every policy)
        if cfg.model.dtype == "auto" and self.dtype != "float32" and self.ui is not None:
            self.ui.note(
                f"engines in {self.dtype} on {device} (model.dtype auto; model.dtype=float32 for fp32)"
            )
        # each policy's live versions, side by side: policy p's sit in the slots = p (mod S), S the
        # run's room for policies (those that may join included)
        staleness = max(p.cfg.flow.max_staleness for p in self.pols)
        slots = (staleness + 3) * self.sched.room
        self.weights = self.hosts.ring(self.layout, slots, self._ring_dtype())
        if self.sched.room > len(self.pols) and self.ui is not None:
            size = self.layout.buffer.numel() * self.weights.dtype.itemsize * slots
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
            relay=str(pol.run.path) if pol.train_cfg.external else None, steps=pol.cfg.flow.steps,
            longest=pol.ses.expected_context(pol.cfg.rollout.max_new_tokens),
        )  # fmt: skip
        pol.trainer = self.workers.start(pol.worker_name, trainer_target(pol.tspec), pol.tspec, self.weights)

    def _ring_dtype(self) -> torch.dtype:
        """What the weights ring holds: bf16 where every policy's engines run bf16 and the built-in
        trainer publishes the whole model (each version rounded once as it is written, as an engine
        rounds an fp32 one as it loads it: the same weights, the ring in half the memory); else the
        trainer's own dtype (a LoRA run publishes adapters; an external trainer's relay checkpoints
        what is published)."""
        half = self.dtype == "bfloat16" and not any(
            p.cfg.train.lora.rank or p.cfg.train.external for p in self.pols
        )
        return torch.bfloat16 if half else self.layout.buffer.dtype

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
            self.dtype,
            start_versions=start,
            from_disk=tuple((v, str(p)) for v, p in sorted(older.items()) if v in start),
            attention=r.attention, max_context=r.max_context,
            kv_memory_gb=r.kv_memory_gb, expected_context=self.expected_context, device=self.device, spec=self.spec,
            backend=r.backend, keep_finished=r.keep_kv and self.tools is not None and self.spec is None,
            max_versions=r.max_versions,
            lora_alpha=self.cfg.train.lora.alpha if self.cfg.train.lora.rank else None,
            lora_init=self.cfg.train.lora.init, lora_rank=self.cfg.train.lora.rank,
            max_adapters=self.weights.slots - self.sched.room,  # each policy's max_staleness + 2 versions
            routes=any(p.cfg.train.routing_replay for p in self.pols),
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
                        f"{p.name}: base policy held-out accuracy {base.accuracy:.1%} {on_prompts(base.summary)}"
                    )
        agent = self.sched if self.endpoint else None  # every policy's scheduler, by the request's model
        while not self.sched.done:
            if agent is not None:  # what the agent sent (requests, groups) goes to the scheduler
                self.endpoint.loop.intake(agent)
            self._handle(self._poll())
            self._pump(timeout=1.0 if agent is None else 0.02)
            if agent is not None:
                self.endpoint.loop.answer(agent)
            self._arrivals()
        self._handle(self._poll(), sync=True)
        finals = [None] * len(self.pols)  # (policies that joined included)
        for k, p in enumerate(self.pols):
            # a policy of several that finished before a resume (a run whose steps a resume raised was
            # evaluated at its old end: not this one's)
            finals[k] = self._recorded_eval(p, "final", p.sched.steps_done)
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

    def _recorded_eval(self, pol: PolicyRun, tag: str, step: int | None = None) -> EvalRecord | None:
        records = read_metrics(pol.run.file("metrics.jsonl"))
        return next(
            (r for r in records if isinstance(r, EvalRecord) and r.tag == tag and step in (None, r.step)),
            None,
        )

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
        self._eval_reqs = {r.id: (p, r) for p, r in zip(evaluator.per_request, reqs)}
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

    def _poll(self) -> list[Outbox]:
        """Every policy's poll. One that raises bad input (a user's store filter) keeps what the poll
        had booked, the trajectories it finished included, in the run directory before it goes up."""
        try:
            return self.sched.poll(self._now())
        except InputError:
            for pol, out in zip(self.pols, self.sched.salvage()):
                self._record(pol, out, sync=True)
            raise

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

    def _trainer_of(self, w: Worker) -> PolicyRun | None:
        return next((p for p in self.pols if p.trainer is w), None)

    # ------------------------------------------------------------------ lines for events.jsonl and the console
    def _event(self, mark: Mark, line: str) -> None:
        self.events.write(mark)
        if self.ui is not None:
            self.ui.note(line)

    def _note(self, recovery: Mark) -> None:
        self.events.write(recovery)
        if self.ui is not None:
            self.ui.note(describe(recovery))

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


def _share_cores(seats: list[Seat]) -> bool:
    """Whether two of these seats pin to a common core (Ray's seats pin to none: each has its bundle)."""
    return any(set(a.cores) & set(b.cores) for k, a in enumerate(seats) for b in seats[k + 1 :])


def _tensorboard(run: RunDir):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "tensorboard=true needs the tensorboard package; pip install 'tailrace[tensorboard]' "
            "or drop --tensorboard"
        ) from None
    return SummaryWriter(str(run.path / "tensorboard"))
