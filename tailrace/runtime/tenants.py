"""`Tenants`: several RL runs (tenants) on one frozen base model, in one process, sharing one engine.

A tenant is a run of its own: its scheduler (`flow.Scheduler`, any mode, unchanged: it believes it
has an engine to itself), its `GRPOTrainer` with a LoRA adapter and its own AdamW state, its reward.
They share one `TailraceEngine`: tenant t's policy version v is the engine adapter "t@v", so one
engine step decodes rows of every tenant (the base GEMMs once, each row's low-rank terms; see
`engine.adapters`). The loop is event-driven: every pass polls each tenant's scheduler and executes
its commands, steps the engine once and hands each finished result to its tenant (scored), then runs
the oldest training order waiting in the one queue all tenants share (the trainer's compute is shared
too). Each scheduler decides when its groups are complete, when it trains and when its weights move, so each
tenant advances at its own pace; a tenant can join (`add`) while the others run and leaves when its
scheduler is done (its adapters dropped).

Request ids are "tenant/id" on the engine; results come back with the tenant's own ids and its versions
(the engine, serving adapters over base version 0, knows nothing of them). In one process training
and rollout take turns (a training thread beside the engine's steps measured slower on two cores:
bench/README.md); across processes the same bookkeeping would sit in the driver
(`runtime/driver.py`), the engine workers holding adapters as they hold versions.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tailrace.engine.engine import TailraceEngine
from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Train
from tailrace.flow.scheduler import Outbox, Scheduler
from tailrace.model.lora import Adapter
from tailrace.trainer.grpo import GRPOTrainer
from tailrace.types import Finish, GenResult, Prompt, Scored

Reward = Callable[
    [Prompt, tuple[int, ...]], tuple[float, bool]
]  # (prompt, response ids) -> (reward, correct)


@dataclass
class Tenant:
    name: str
    scheduler: Scheduler
    trainer: GRPOTrainer  # with train.lora set: its adapter is what the engine serves
    reward: Reward
    steps: list[dict] = field(default_factory=list)  # the trainer's metrics per step, with "t" (clock)
    published: dict[int, Adapter] = field(default_factory=dict)  # version -> adapter weights
    versions: dict[str, tuple[int, int]] = field(default_factory=dict)  # engine id -> (version, resumed)
    started: float = 0.0
    finished: float | None = None

    def adapter_name(self, version: int) -> str:
        return f"{self.name}@{version}"


class Tenants:
    def __init__(self, engine: TailraceEngine, clock: Callable[[], float] = time.perf_counter):
        if not engine.capabilities.adapters:
            raise ValueError("Tenants needs an engine that serves LoRA adapters (capabilities.adapters)")
        self.engine, self.clock = engine, clock
        self.live: dict[str, Tenant] = {}
        self.done: list[Tenant] = []
        self._queue: deque[tuple[Tenant, Train]] = deque()  # training orders, all tenants, FIFO
        self.busy_s = self.slot_s = 0.0  # engine step seconds, and those times the decode rows

    def add(self, tenant: Tenant) -> None:
        """A tenant joins (now, or while others run): its version 0 is its trainer's adapter as it is."""
        if tenant.name in self.live or "/" in tenant.name or "@" in tenant.name:
            raise ValueError(
                f"tenant name {tenant.name!r}: give each live tenant a unique name without / or @"
            )
        tenant.published[0] = tenant.trainer.adapter()
        self.engine.load_adapter(tenant.adapter_name(0), tenant.published[0])
        tenant.started = self.clock()
        self.live[tenant.name] = tenant

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Until every tenant's scheduler is done (or `until()` holds)."""
        while self.live and not (until and until()):
            commands = 0
            for t in list(self.live.values()):
                out = t.scheduler.poll(self.clock())
                commands += len(out.commands)
                self._execute(t, out)
                if t.scheduler.done:
                    self._leave(t)
            worked = self._step_engine()
            if self._queue:
                t, order = self._queue.popleft()
                self._finish(t, order, *self._step(t, order))
            elif self.live and not (commands or worked):
                raise RuntimeError(
                    f"tenants {sorted(self.live)} wait on nothing: no command, no request in the engine "
                    "and no training order queued"
                )

    # -- commands -----------------------------------------------------------------------------------

    def _execute(self, t: Tenant, out: Outbox) -> None:
        now = self.clock()
        for c in out.commands:
            if isinstance(c, Generate):
                for r in c.requests:
                    rid = f"{t.name}/{r.id}"
                    t.versions[rid] = (r.version, len(r.resume_ids))
                    self.engine.add(
                        dataclasses.replace(r, id=rid, version=0, adapter=t.adapter_name(r.version))
                    )
            elif isinstance(c, Abort):
                parts = [self._own(t, self.engine.abort(f"{t.name}/{rid}")) for rid in c.request_ids]
                t.scheduler.on_results(c.engine, parts, [], now)
            elif isinstance(c, Train):
                self._queue.append((t, c))
            elif isinstance(c, LoadWeights):
                self.engine.load_adapter(t.adapter_name(c.version), t.published[c.version])
                t.scheduler.on_loaded(c.engine, c.version, now)
            elif isinstance(c, DropWeights):
                self.engine.drop_adapter(t.adapter_name(c.version))

    def _own(self, t: Tenant, res: GenResult) -> GenResult:
        """An engine result as the tenant's scheduler knows it: its own id, and its version on the tokens
        this engine drew (the resumed ones keep theirs)."""
        v, n_res = t.versions.pop(res.request_id)
        new = len(res.token_ids) - n_res
        return dataclasses.replace(
            res, request_id=res.request_id.split("/", 1)[1], versions=res.versions[:n_res] + (v,) * new
        )

    def _step_engine(self) -> bool:
        if not (self.engine.num_running or self.engine.num_waiting):
            return False
        ev = self.engine.step()
        self.busy_s += ev.duration
        self.slot_s += ev.duration * ev.active
        now = self.clock()
        by_tenant: dict[str, list[GenResult]] = {}
        for res in ev.finished:
            by_tenant.setdefault(res.request_id.split("/", 1)[0], []).append(res)
        for name, results in by_tenant.items():
            t = self.live[name]
            own = [self._own(t, r) for r in results]
            scores = []
            for r in own:
                if r.finish != Finish.ABORTED and not t.scheduler.is_pregen(r.request_id):
                    reward, correct = t.reward(t.scheduler.prompt_of(r.request_id), r.token_ids)
                    scores.append(Scored(r.request_id, reward, correct))
            t.scheduler.on_results(0, own, scores, now)
        return True

    @staticmethod
    def _step(t: Tenant, order: Train) -> tuple[dict, Adapter | None]:
        """One optimizer step of `t`: its metrics and, when the order publishes, the adapter's new
        weights. Touches nothing but the tenant's trainer (a worker could run it)."""
        metrics = t.trainer.step(list(order.groups), order.trainer_version)
        return metrics, t.trainer.adapter() if order.publish is not None else None

    def _finish(self, t: Tenant, order: Train, metrics: dict, adapter: Adapter | None) -> None:
        now = self.clock()
        t.steps.append({**metrics, "t": now - t.started})
        if order.publish is not None:
            t.published[order.publish] = adapter
        t.scheduler.on_trained(order.step, now)
        if order.publish is not None:
            t.scheduler.on_published(order.publish, now)

    def _leave(self, t: Tenant) -> None:
        """A done tenant's requests still in the engine (a streaming mode's, generated ahead) are
        aborted and its adapters dropped."""
        for rid in list(t.versions):
            self.engine.abort(rid)
            del t.versions[rid]
        for v in list(t.published):
            if t.adapter_name(v) in self.engine.adapters:
                self.engine.drop_adapter(t.adapter_name(v))
        t.finished = self.clock()
        del self.live[t.name]
        self.done.append(t)
