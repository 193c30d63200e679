"""The driver's handling of what workers report (a mixin of `Driver`, kept apart so the loop reads on
its own): an engine's results scored (each by its policy's task) and handed to the scheduler, its loads
and spans recorded, drafters' material relayed to the other engines; a multi-turn result that stopped
at a tool call parked while the tool runs; a trainer's finished step turned into the step record and,
when asked for, a whole checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from tailrace.config import dump_config
from tailrace.flow.commands import Generate
from tailrace.flow.external import is_external
from tailrace.metrics import step_record
from tailrace.records import CheckpointRecord, Span, StepRecord
from tailrace.runtime import checkpoint
from tailrace.runtime.evaluate import next_turn
from tailrace.runtime.messages import EngineReport, History, TrainerReport
from tailrace.runtime.policy_run import PolicyRun
from tailrace.runtime.tools import Failed
from tailrace.tasks.env import Turn
from tailrace.types import Finish, GenResult, Prompt, Scored, Trajectory


class Reports:
    # ------------------------------------------------------------------ reports
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
            return self.pols[0].ses.train_scores(prompts, results)
        scores: list[Scored] = []
        for pol in self.pols:
            mine = [k for k, r in enumerate(results) if self.sched.policy_of(r.request_id) == pol.index]
            if mine:
                scores += pol.ses.train_scores([prompts[k] for k in mine], [results[k] for k in mine])
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
            flat = self.weights.read(rep.published)
            intact = partial(self.weights.intact, rep.published, flat)
            kept = pol.snapshots.take(sched.steps_done, published, record.time["wall_s"], flat.buffer, intact)
            if kept is None and self.ui is not None:  # the trainer began rewriting the slot meanwhile
                self.ui.note(
                    f"snapshot of version {published} dropped: its ring slot was rewritten while saved"
                )
        if self.tb is not None:
            for key, value in _flatten(record.to_json(), f"{pol.name}/" if pol.name else ""):
                self.tb.add_scalar(key, value, rep.step + 1)
        if self.ui is not None:
            self.ui.step(record, saved, pol.name, pol.cfg.flow.zero_signal == "replace")

    def _checkpoint(self, pol: PolicyRun, rep: TrainerReport, published: int | None) -> CheckpointRecord:
        """Make the trainer's half-written checkpoint whole: everything it counts is on disk first."""
        self._handle(self._poll(), sync=True)
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
            pol.ses.take_reward_parts(),
        )  # fmt: skip

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


def _flatten(d: dict, prefix: str = ""):
    """('length/p50', 37.0)... for every numeric leaf of a step record."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
            yield prefix + k, v
