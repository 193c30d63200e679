"""Scheduler checkpoints and journal replay: resume loses no finished trajectory, repeats no step.

A checkpoint is taken right after train step n is durable. It records the state *as of the finished
steps*: groups handed to steps that had not finished go back to ready (they will be trained again,
by a step that really happens), samples in flight go back to the group's to-do list (their work is
regenerated), and the trainer version is the one the checkpointed weights hold. The journal —
entries the scheduler emitted after the checkpoint — is then replayed on top: groups opened and
trajectories finished since come back exactly as they were.
"""

from __future__ import annotations

from collections import Counter

from tailrace.flow.ledger import Ledger
from tailrace.flow.serde import prompt_from_dict, prompt_to_dict, traj_from_dict, traj_to_dict
from tailrace.flow.store import GroupState


def _group_dict(g: GroupState) -> dict:
    in_flight = sorted(int(sid.split(".")[1]) for sid in g.in_flight)
    return {
        "id": g.id,
        "prompt": prompt_to_dict(g.prompt),
        "version": g.version,
        "wanted": g.wanted,
        "keep": g.keep,
        "opened": g.opened,
        "dispatched": g.dispatched - len(in_flight),
        "discarded": g.discarded,
        "todo": sorted(g.todo + in_flight),
        "done": [traj_to_dict(t) for t in g.done],
    }


def _group_from(d: dict) -> GroupState:
    return GroupState(
        id=d["id"],
        prompt=prompt_from_dict(d["prompt"]),
        version=d["version"],
        wanted=d["wanted"],
        keep=d["keep"],
        opened=d["opened"],
        dispatched=d["dispatched"],
        discarded=d["discarded"],
        todo=list(d["todo"]),
        done=[traj_from_dict(t) for t in d["done"]],
    )


def state_dict(s) -> dict:
    unfinished = [g for step in sorted(s.store.training) for g in s.store.training[step]]
    return {
        "prompts_taken": s.prompts_taken,
        "next_group": s.next_group,
        "version": s.done_version,
        "steps_done": s.steps_done,
        "ledger": s.ledger.state_dict(),
        "staleness": dict(s.staleness),
        "journal_seq": s.journal_seq,
        "requeued": [prompt_to_dict(p) for p in s.requeued],
        "open": [_group_dict(g) for g in s.store.open.values()],
        "ready": [_group_dict(g) for g in unfinished + list(s.store.ready.values())],
        "policy": s.policy.state_dict(),
    }


def load_state_dict(s, d: dict) -> None:
    """Restore a fresh scheduler (built with the same policy, spec and prompt stream)."""
    for _ in range(d["prompts_taken"]):
        next(s.prompts)
    s.prompts_taken, s.next_group = d["prompts_taken"], d["next_group"]
    s.trainer_version = s.done_version = d["version"]
    s.published = {d["version"]}
    for e in s.engines:
        e.loaded = {d["version"]}
    s.steps_done = s.steps_issued = d["steps_done"]
    s.ledger = Ledger.from_state(d["ledger"])
    s.staleness = Counter({int(k): v for k, v in d["staleness"].items()})
    s.journal_seq = d["journal_seq"]
    s.requeued = [prompt_from_dict(p) for p in d["requeued"]]
    for gd in d["open"]:
        s.store.add_group(_group_from(gd))
    for gd in d["ready"]:
        g = _group_from(gd)
        s.store.ready[g.id] = g
    s.policy.load_state_dict(d["policy"])


def replay(s, entries: list[dict]) -> None:
    """Apply journal entries written after the checkpoint (in order)."""
    for e in entries:
        kind = e["kind"]
        if kind == "open":
            if e.get("requeued"):
                s.requeued.pop(0)
            else:
                next(s.prompts)
            g = GroupState(
                id=e["group"],
                prompt=prompt_from_dict(e["prompt"]),
                version=e["version"],
                wanted=e["wanted"],
                keep=e["keep"],
                opened=s.now,
            )
            s.store.add_group(g)
            s.prompts_taken, s.next_group = e["prompts_taken"], e["group"] + 1
        elif kind == "done":
            t = traj_from_dict(e["trajectory"])
            g = s.store.open[t.group]
            g.todo.remove(t.sample_index)
            g.dispatched += 1
            s.ledger.on_produced()
            if max(t.versions, default=t.dispatch_version) > s.done_version:
                # made by weights of a step that did not survive the crash: accounted, not trained
                s.ledger.on_discarded("resume:weights-lost")
                g.todo.append(t.sample_index)
                g.dispatched -= 1  # the sample will be generated again; the lost one is accounted above
            else:
                g.done.append(t)
            s._maybe_ready(g)
        elif kind == "discard":
            g = s.store.open.get(e["group"])
            if g is not None and e["index"] in g.todo:
                g.todo.remove(e["index"])
                g.dispatched += 1
                g.discarded += 1
            s.ledger.on_produced()
            s.ledger.on_discarded(e["reason"])
            if g is not None:
                s._maybe_ready(g)
        s.journal_seq += 1
    # groups opened under weights that did not survive are un-opened: their prompts go back to the
    # front of the queue (their finished samples were discarded above, with a reason)
    for g in sorted(s.store.open.values(), key=lambda g: g.id):
        if g.version > s.done_version:
            assert not g.done and not g.in_flight
            del s.store.open[g.id]
            s.requeued.append(g.prompt)
