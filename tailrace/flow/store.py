"""The trajectory store: samples grouped by prompt, from first dispatch to training.

A group is *open* while samples are still wanted, *ready* once complete (FIFO in completion
order, waiting for the trainer), *training* once handed to a train step, and leaves the store when
that step is done. Trajectories inside the store count as `in_store` for the ledger.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tailrace.types import Prompt, Trajectory


@dataclass
class GroupState:
    id: int
    prompt: Prompt
    version: int  # dispatch version of the group's samples (the newest live version when opened)
    wanted: int  # samples to dispatch for this group (over-sampling may raise it above K)
    keep: int  # samples the group trains on (K)
    opened: float
    dispatched: int = 0
    todo: list[int] = field(default_factory=list)  # sample indices not yet dispatched
    done: list[Trajectory] = field(default_factory=list)
    in_flight: set[str] = field(default_factory=set)  # sample ids
    discarded: int = 0  # dispatched samples that left for good (early stop, ...)
    completed_at: float | None = None

    def __post_init__(self) -> None:
        if not self.todo and not self.dispatched:
            self.todo = list(range(self.wanted))


class Store:
    def __init__(self) -> None:
        self.open: dict[int, GroupState] = {}
        self.ready: OrderedDict[int, GroupState] = OrderedDict()
        self.training: dict[int, list[GroupState]] = {}  # train step -> its groups

    def add_group(self, g: GroupState) -> None:
        self.open[g.id] = g

    def mark_ready(self, gid: int, now: float) -> GroupState:
        g = self.open.pop(gid)
        g.completed_at = now
        self.ready[gid] = g
        return g

    def take(self, gids: list[int], step: int) -> list[GroupState]:
        groups = [self.ready.pop(gid) for gid in gids]
        self.training[step] = groups
        return groups

    def trained(self, step: int) -> list[GroupState]:
        return self.training.pop(step)

    def in_store(self) -> int:
        """Trajectories held (open, ready or in training), recounted from the data, not a counter."""
        n = sum(len(g.done) for g in self.open.values()) + sum(len(g.done) for g in self.ready.values())
        return n + sum(len(g.done) for gs in self.training.values() for g in gs)

    def all_groups(self):
        yield from self.open.values()
        yield from self.ready.values()
        for gs in self.training.values():
            yield from gs
