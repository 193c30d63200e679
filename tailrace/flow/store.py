"""The trajectory store: samples grouped by prompt, from first dispatch to training.

A group is *open* while samples are still wanted, *ready* once complete (FIFO in completion
order, waiting for the trainer), *training* once handed to a train step, and leaves the store when
that step is done, or straight from ready when dropped (a zero-signal group a policy replaces).
Trajectories inside the store count as `in_store` for the ledger.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator

from tailrace.flow.keys import SampleKey
from tailrace.records import prompt_from_json, prompt_to_json, trajectory_from_json, trajectory_to_json
from tailrace.types import Prompt, Trajectory


@dataclass
class GroupState:
    id: int
    prompt: Prompt
    version: int  # dispatch version of the group's samples (the newest live version when opened)
    size: int  # samples the group trains on
    opened: float
    dispatched: int = 0
    todo: list[int] = field(default_factory=list)  # sample indices not yet dispatched
    done: list[Trajectory] = field(default_factory=list)
    in_flight: set[SampleKey] = field(default_factory=set)
    discarded: int = 0  # dispatched samples that left for good (early stop, ...)
    completed_at: float | None = None
    candidates: int = 0  # samples generated for the prompt (shaping may ask for more than size; 0 = size)
    early_stop: bool = False  # shaping stops the group at its first `size` non-truncated finishers
    own: bool = False  # its prompt came from shaping's own queue (tailbatch's tail round, sorted's cache)
    deferred: bool = False  # shaping gave the group up: it drains, its samples are discarded
    parked: list[Trajectory] = field(default_factory=list)  # aborted partials waiting to be resumed
    external: bool = False  # an external agent's group, complete when it came (flow/external.py)
    kept: bool | None = None  # store.filter's verdict, asked once (flow/filters.py); None = not asked

    def __post_init__(self) -> None:
        self.candidates = self.candidates or self.size
        if not self.todo and not self.dispatched:
            self.todo = list(range(self.candidates))

    @property
    def zero_signal(self) -> bool:
        """Every reward the group trains on is equal: each advantage is zero, so it teaches nothing."""
        return len({t.reward for t in self.done}) <= 1

    def to_json(self) -> dict:
        """As of the finished steps: samples in flight or parked go back to the to-do list (regenerated)."""
        back = sorted([k.index for k in self.in_flight] + [t.sample_index for t in self.parked])
        return {
            "id": self.id, "prompt": prompt_to_json(self.prompt), "version": self.version,
            "size": self.size, "opened": self.opened, "dispatched": self.dispatched - len(back),
            "discarded": self.discarded, "todo": sorted(self.todo + back),
            "done": [trajectory_to_json(t) for t in self.done], "candidates": self.candidates,
            "early_stop": self.early_stop, "own": self.own, "deferred": self.deferred,
            **({"external": True} if self.external else {}),
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> GroupState:
        prompt = prompt_from_json(d["prompt"])
        return cls(
            id=d["id"], prompt=prompt, version=d["version"], size=d["size"], opened=d["opened"],
            dispatched=d["dispatched"], discarded=d["discarded"], todo=list(d["todo"]),
            done=[trajectory_from_json(t, prompt.token_ids) for t in d["done"]],
            candidates=d.get("candidates", 0), early_stop=d.get("early_stop", False),
            own=d.get("own", False), deferred=d.get("deferred", False), external=d.get("external", False),
        )  # fmt: skip


class Store:
    def __init__(self) -> None:
        self.open: dict[int, GroupState] = {}
        self.ready: OrderedDict[int, GroupState] = OrderedDict()
        self._training: dict[int, list[GroupState]] = {}  # train step -> its groups
        self._training_ids: set[int] = set()

    def add_group(self, g: GroupState) -> None:
        self.open[g.id] = g

    def mark_ready(self, gid: int, now: float) -> GroupState:
        g = self.open.pop(gid)
        g.completed_at = now
        self.ready[gid] = g
        return g

    def drop(self, gid: int) -> GroupState:
        """A ready group leaves without being trained."""
        return self.ready.pop(gid)

    def remove_open(self, gid: int) -> GroupState:
        """An open group leaves without being trained (deferred by shaping, once drained)."""
        return self.open.pop(gid)

    def take(self, gids: list[int], step: int) -> list[GroupState]:
        groups = [self.ready.pop(gid) for gid in gids]
        self._training[step] = groups
        self._training_ids.update(gids)
        return groups

    def trained(self, step: int) -> list[GroupState]:
        groups = self._training.pop(step)
        self._training_ids.difference_update(g.id for g in groups)
        return groups

    def in_training(self, gid: int) -> bool:
        return gid in self._training_ids

    def in_store(self) -> int:
        """Trajectories held (open, ready or in training), recounted from the data, not a counter."""
        return sum(len(g.done) for g in self.all_groups())

    def queued(self) -> Iterator[GroupState]:
        """Groups not yet handed to a train step: open, then ready."""
        yield from self.open.values()
        yield from self.ready.values()

    def all_groups(self) -> Iterator[GroupState]:
        yield from self.queued()
        for gs in self._training.values():
            yield from gs

    # -- checkpoints ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        """As of the finished steps: groups handed to unfinished steps go back to ready (a step that
        really happens will train them), ahead of the groups that were ready."""
        unfinished = [g for step in sorted(self._training) for g in self._training[step]]
        return {
            "open": [g.to_json() for g in self.open.values()],
            "ready": [g.to_json() for g in unfinished + list(self.ready.values())],
        }

    def load_json(self, d: dict) -> None:
        for gd in d["open"]:
            self.add_group(GroupState.from_json(gd))
        for gd in d["ready"]:
            g = GroupState.from_json(gd)
            self.ready[g.id] = g
