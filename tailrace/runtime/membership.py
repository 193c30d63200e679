"""The driver's workers coming and going (a mixin of `Driver`, kept apart so the loop reads on its own):
a lost worker replaced (an engine holding the versions the scheduler says it held, the trainer from
its newest whole checkpoint); engines joining and leaving a running job (runtime/join.py's desk);
policies joining and leaving (tailrace policy join / leave); a worker's `Ready`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from functools import partial
from pathlib import Path

from tailrace.common import ConfigError, Fault, InputError, one_line
from tailrace.config import dump_config
from tailrace.config.load import policy_configs
from tailrace.flow.commands import Generate
from tailrace.records import Mark
from tailrace.runtime.engine_worker import engine_main
from tailrace.runtime.evaluate import Evaluator
from tailrace.runtime.health import Heard, Lost
from tailrace.runtime.hosts import Seat, Started
from tailrace.runtime.join import Arrival, Asked, Leave, PolicyJoin, Welcome, serve_weights
from tailrace.runtime.messages import Ready
from tailrace.runtime.metrics import Utilization
from tailrace.runtime.procs import available_cores
from tailrace.runtime.recovery import weights_on_disk
from tailrace.runtime.run_modes import run_capabilities, with_mode
from tailrace.runtime.session import Session
from tailrace.runtime.tools import ToolPool
from tailrace.runtime.trainer_worker import trainer_target
from tailrace.runtime.workers import Worker


class Membership:
    # ------------------------------------------------------------------ recovery
    def _memory_hint(self, lost: Lost) -> str:
        """For a worker killed by SIGKILL (the kernel's out-of-memory killer, most likely): what the run
        keeps in memory beside its workers' own, and the settings that need less."""
        if "SIGKILL" not in lost.line:
            return ""
        cfg = self.pols[0].cfg
        tries = []
        if not cfg.train.lora.rank:
            tries.append("--train.lora.rank=8 (no optimizer state for the base; adapters published)")
        k = cfg.flow.max_staleness
        if cfg.flow.mode != "sync" and k > 0:
            tries.append(
                f"--flow.mode=sync (one version in each engine; {cfg.flow.mode} keeps up to {k + 1})"
            )
        if self.dtype == "float32":
            tries.append(
                "--model.dtype=bfloat16 (engines, and a full fine-tune's published weights, in half the memory)"
            )
        buf = getattr(getattr(self, "weights", None), "buf", None)  # the local runtime's ring, once made
        held = (
            f"; the run holds {buf.numel() * buf.element_size() / 2**30:.1f} GiB of published weights in "
            f"shared memory ({buf.shape[0]} versions) beside its workers"
            if buf is not None
            else ""
        )
        return held + ("; with less memory, try " + ", ".join(tries) if tries else "")

    def _replace(self, w: Worker, lost: Lost) -> None:
        now = self._now()
        if w.elastic:  # a joined engine is not the driver's to restart: it leaves, its samples requeued
            self._leave(next(k for k, x in self.engines.items() if x is w), lost.line)
            return
        if not self.recovery.allows(lost, now):
            raise Fault(self.recovery.refusal(lost) + self._memory_hint(lost))
        pol = self._trainer_of(w)
        if pol is not None:
            start = str(pol.restart_from) if pol.restart_from else None  # None: the run's start
            spec = replace(pol.tspec, resume_from=start, publish_start=False)
            pol.trainer = self.workers.replace(w, trainer_target(spec), spec, self.weights)
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
        self.workers.send(w, Welcome(eid, spec, self.layout.layout, self.weights.dtype))
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

    def _join_cores(self) -> tuple[int, ...]:
        """A core no worker is pinned to, if there is one; else the first engine's (a joined engine
        shares the rollout pool's cores, never the trainer's unless they are all there is)."""
        used = {c for s in self.seats for c in s.cores} | {c for e in self.especs.values() for c in e.cores}
        free = [c for c in available_cores() if c not in used]
        return (free[0],) if free else self.especs[min(self.especs)].cores

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

    # ------------------------------------------------------------------ a worker up
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


class _JoinerLost(Exception):
    """A joining policy's trainer died or failed before it was ready."""


def _replace_text(path: Path, text: str) -> None:
    """`path` holds `text`, whole or not at all (a crash mid-write leaves the old file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
