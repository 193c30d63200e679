"""Scheduler checkpoints and journal replay: resume loses no finished trajectory, repeats no step.

A checkpoint is taken right after train step n is durable. It records the state *as of the finished
steps*: groups handed to steps that had not finished go back to ready (they will be trained again,
by a step that really happens), samples in flight go back to the group's to-do list (their work is
regenerated), and the trainer version is the one the checkpointed weights hold. The journal —
entries the scheduler emitted after the checkpoint — is then replayed on top: groups opened and
trajectories finished since come back exactly as they were.

These are methods of `Scheduler` (a mixin, to keep each file to one concern); they use its store's
own checkpoint operations.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Iterable

from tailrace.flow.ledger import Ledger
from tailrace.flow.shaping import Plan
from tailrace.flow.store import GroupState
from tailrace.records import (
    Deferred,
    Discarded,
    Dropped,
    Finished,
    JournalEntry,
    Opened,
    prompt_from_json,
    prompt_to_json,
)


class SchedulerState:
    def state_dict(self) -> dict:
        """The checkpoint; take it after a poll (the journal entries it counts must all be handed out,
        or a resume would miss them)."""
        if self._out.journal:
            raise RuntimeError(
                f"state_dict with {len(self._out.journal)} journal entries not yet handed out; poll "
                "and record the outbox first"
            )
        return {
            "prompts_taken": self.prompts_taken, "groups_opened": self.groups_opened,
            "groups_withdrawn": self.groups_withdrawn,
            "version": self.done_version, "steps_done": self.steps_done, "ledger": self.ledger.state_dict(),
            "staleness": dict(self.staleness), "journal_seq": self.journal_seq,
            "groups_done": dict(self.groups_done), "groups_dropped": dict(self.groups_dropped),
            "requeued": [prompt_to_json(p) for p in self._requeued], **self._store.to_json(),
            "policy": self.policy.state_dict(), "shaping": self.shaping.state_dict(),
            "upcoming": [[prompt_to_json(p), n.candidates, n.early_stop] for p, n in self._upcoming],
            **({"replay": self.replay_buffer.to_json()} if self.replay_buffer is not None else {}),
        }  # fmt: skip

    def load_state_dict(self, d: dict) -> None:
        """Restore a fresh scheduler (built with the same policy, spec and prompt stream)."""
        for _ in range(d["prompts_taken"]):
            next(self._prompts)
        self.prompts_taken, self.groups_opened = d["prompts_taken"], d["groups_opened"]
        self.groups_withdrawn = d.get("groups_withdrawn", 0)  # older checkpoints lack it
        self.trainer_version = self.done_version = d["version"]
        self.published = {d["version"]}
        for e in self.engines:
            e.loaded = {d["version"]}
        self.steps_done = self.steps_issued = d["steps_done"]
        self.ledger = Ledger.from_state(d["ledger"])
        self.staleness = Counter({int(k): v for k, v in d["staleness"].items()})
        self.journal_seq = d["journal_seq"]
        self.groups_done = Counter(d.get("groups_done", {}))  # older checkpoints lack them
        self.groups_dropped = Counter(d.get("groups_dropped", {}))
        self._requeued = [prompt_from_json(p) for p in d["requeued"]]
        self._store.load_json(d)
        self.policy.load_state_dict(d["policy"])
        self.shaping.load_state_dict(d.get("shaping", {}))  # older checkpoints: no shaping state
        self._upcoming = [(prompt_from_json(p), Plan(n, early)) for p, n, early in d.get("upcoming", [])]
        if self.replay_buffer is not None and "replay" in d:  # (a checkpoint of a run without replay: empty)
            self.replay_buffer.load_json(d["replay"])
        for g in list(self._store.open.values()):  # a group shaping had cut: its in-flight went to todo
            self._maybe_ready(g)

    def replay(self, entries: Iterable[JournalEntry]) -> None:
        """Apply the journal entries written after the checkpoint, in order. A group shaping cut short
        is cut at its last entry: the samples it had in flight when it was cut are in its to-do list
        here, and those that came back (finished, or aborted and discarded) have entries after the cut."""
        store = self._store
        entries = list(entries)
        last = {_group_of(e): i for i, e in enumerate(entries) if isinstance(e, (Finished, Discarded))}
        for i, e in enumerate(entries):
            if isinstance(e, Opened):
                if e.own:  # from shaping's own queue, as the journal says (not the stream)
                    self.shaping.claim(e.prompt)
                elif not e.external:  # the plan is the journal's (stats may differ after lost weights)
                    self._next_prompt()
                store.add_group(
                    GroupState(
                        e.group, e.prompt, e.version, self.spec.samples_per_prompt, self.now,
                        candidates=e.candidates, early_stop=e.early_stop, own=e.own, external=e.external,
                    )
                )  # fmt: skip
                self.prompts_taken, self.groups_opened = e.prompts_taken, e.group + 1
            elif isinstance(e, Finished):
                g = store.open.get(e.trajectory.group)
                if g is None:  # finished after shaping cut its group, which the checkpoint's load closed
                    self.ledger.on_produced()
                    self.ledger.on_discarded("shaping")
                    self.journal_seq += 1
                    continue
                t = replace(e.trajectory, prompt_ids=g.prompt.token_ids)  # the journal keeps them once
                g.todo.remove(t.sample_index)
                self.ledger.on_produced()
                if max(t.versions, default=t.dispatch_version) > self.done_version:
                    # made by weights of a step that did not survive the crash: accounted, not trained
                    self.ledger.on_discarded("resume:weights-lost")
                    g.todo.append(t.sample_index)  # generated again; the lost one is accounted above
                else:
                    g.dispatched += 1
                    g.done.append(t)
                self._maybe_ready(g, cut=last[g.id] == i)
            elif isinstance(e, Discarded):
                g = store.open.get(e.group)
                if g is not None and e.index in g.todo:
                    g.todo.remove(e.index)
                    g.dispatched += 1
                    g.discarded += 1
                self.ledger.on_produced()
                self.ledger.on_discarded(e.reason)
                if g is not None:
                    self._maybe_ready(g, cut=last[g.id] == i)
            elif isinstance(e, Deferred):  # drains at its last entry, or at the end (below)
                if e.group in store.ready:
                    store.add_group(store.ready.pop(e.group))
                g = store.open[e.group]
                g.deferred = True
                self.groups_done["deferred"] += 1
                self.shaping.defer(g.prompt)
            elif isinstance(e, Dropped):
                if e.group in store.ready:  # else its samples were lost with their weights (above)
                    self.ledger.on_discarded(e.reason, len(store.drop(e.group).done))
                    self.groups_dropped[e.reason] += 1
            self.journal_seq += 1
        # an agent's group with samples made by weights that did not survive cannot make them again:
        # it leaves, its other samples discarded (the agent's completions of lost weights are gone)
        for g in [g for g in store.open.values() if g.external and g.todo]:
            del store.open[g.id]
            self.ledger.on_discarded("resume:weights-lost", len(g.done))
        # groups opened under weights that did not survive are un-opened: their prompts go back to the
        # front of the queue (their finished samples were discarded above, with a reason)
        for g in sorted(store.open.values(), key=lambda g: g.id):
            if g.version > self.done_version:
                assert not g.done and not g.in_flight
                del store.open[g.id]
                self.groups_withdrawn += 1  # its id stays used: the journal names it
                if not g.deferred:  # a deferred group's prompt is in shaping's queue already
                    self._requeued.append(g.prompt)
        for g in list(store.open.values()):  # cut while samples were in flight that never came back
            self._maybe_ready(g)


def _group_of(e: Finished | Discarded) -> int:
    return e.trajectory.group if isinstance(e, Finished) else e.group
