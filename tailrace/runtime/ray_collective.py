"""Weight transfer trainer -> engines by a collective (`runtime.weights=collective`): a broadcast over
a torch.distributed group of the trainer (rank 0) and the run's first engine actors (ranks 1..N),
gloo on CPU, NCCL on CUDA (wired, untested on GPU here). A run of several policies has one such group
per trainer (`senders`), each with every engine in it: an engine receives in one thread per group.

Each engine actor runs a receiver thread that stages every broadcast version in a ring of its own
(`slots` versions in its memory, or on its GPU), so an engine loads a version at its own pace with a
local copy, as from the shared-memory ring. Per version the trainer broadcasts the version number,
then its flat buffer, then all-reduces a one-element ack: when `write` returns (and the trainer
reports the version) every member has staged it, so the driver's `LoadWeights` never races it.
Several senders' versions never share a slot (policy p's engine versions are p mod P, and P divides
the ring's slots), so their receivers never write the same one.

The object store stays the record of every version (runtime/ray_weights.py): the trainer puts each
one there too, after its broadcast. That is what makes the collective safe to lose:
the driver (snapshots, a replacement's start versions), a replacement engine (it cannot join a group
of fixed membership) and a replacement trainer read and write the store only, and a member whose
ring lacks a version reads it there. The group is formed once, when the first trainer and engines
start, and never re-formed: a member lost (its sockets close), a broadcast not all members take within
`SEND_S`, or a group that did not form within `JOIN_S` ends the collective for the rest of the run —
the trainer aborts the group (which ends every receiver's wait) and the object store carries on.
A stopped engine blocks a broadcast until the driver kills it (worker_timeout_s) or `SEND_S`.
All of this is gloo's behaviour, tested here; NCCL reports a lost member through its watchdog, which
by default ends the process after the timeout (the driver would then replace the trainer): untested.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from functools import partial
from typing import Any

import torch

from tailrace.common import one_line
from tailrace.model.flat import FlatWeights, Layout
from tailrace.runtime.ray_weights import StoreWeights

JOIN_S = 120.0  # for every member to join the group (engines join before they load their model)
SEND_S = 60.0  # for the members to take one version's broadcast
WAIT_S = 7 * 24 * 3600.0  # a receiver's wait for the next version: the run's length; a lost trainer ends it

Place = tuple[str, int, int, int, int]  # a group's (host, port), this member's rank, the group's size, its id


class Collective:
    """The driver's end: where the groups meet (a TCPStore the driver hosts) and the object store.
    The driver itself reads and writes the store (it is no member); `end` gives each worker its own.
    `world`: a group's size (its trainer and the engines); `senders`: the trainers' worker names, one
    group each."""

    def __init__(
        self, store: StoreWeights, numel: int, host: str, world: int, device: str,
        senders: tuple[str, ...] = ("trainer",),
    ) -> None:  # fmt: skip
        self.store, self.numel, self.host, self.world, self.device = store, numel, host, world, device
        self.senders = tuple(senders)
        self.master = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)

    @property
    def slots(self) -> int:
        return self.store.slots

    def write(self, version: int, buffer: torch.Tensor) -> None:
        self.store.write(version, buffer)

    def holds(self, version: int) -> bool:
        return self.store.holds(version)

    def read(self, version: int) -> FlatWeights:
        return self.store.read(version)

    def intact(self, version: int, flat: FlatWeights) -> bool:
        return self.store.intact(version, flat)

    def end(self, name: str, first: bool) -> Any:
        """What worker `name` gets: a member's end when it is the first process of that name (a trainer
        rank 0 of its own group, engine i rank i + 1 of every group), else the object store alone."""
        if not first:
            return self.store
        port = self.master.port
        if name in self.senders:
            seats = ((self.host, port, 0, self.world, self.senders.index(name)),)
        else:
            rank = int(name.removeprefix("engine")) + 1
            seats = tuple((self.host, port, rank, self.world, g) for g in range(len(self.senders)))
        return Member(self.store, self.numel, seats, self.device)


class Member:
    """A member's end of the ring (write / read / holds / slots), built in its worker process
    (`__reduce__`): it joins its group (an engine: each group) in a thread there; an engine's thread
    then receives."""

    def __init__(self, store: StoreWeights, numel: int, seats: tuple[Place, ...], device: str):
        self.store, self.numel, self.device = store, numel, device
        self.seats = seats  # per group: where it meets (host, port), this member's rank, its size, its id
        self.groups: list[Any] = [None] * len(seats)  # each process group, once formed; None once it failed
        self.ring: torch.Tensor | None = None  # an engine's staged versions, (slots, numel)
        self.versions = [-1] * store.slots  # the version in each slot of `ring` (-1: none, or torn)
        self.arrived: deque[tuple[int, float, float]] = deque()  # (version, t0, t1) not yet reported
        self._lock = threading.Lock()  # the receivers' one ring is made once

    def __reduce__(self):
        return (_start, (self.store, self.numel, self.seats, self.device))

    @property
    def layout(self) -> Layout:
        return self.store.layout

    @property
    def dtype(self) -> torch.dtype:
        return self.store.dtype

    @property
    def group(self) -> Any:
        """A trainer's group (an engine's first)."""
        return self.groups[0]

    @property
    def slots(self) -> int:
        return self.store.slots

    # -- the trainer (rank 0) ---------------------------------------------------------------------

    def write(self, version: int, buffer: torch.Tensor) -> None:
        """Broadcast `version` to the group, then put it into the object store: one after the other,
        as at the same time they contend for cores and memory and took longer on 2 cores than the
        two in turn (bench/README.md)."""
        buffer = buffer.detach().reshape(-1).to(self.dtype)  # rounded to the ring's dtype, once
        try:
            for work in self._send(version, buffer):
                work.wait()
        except RuntimeError as e:  # a member lost or too slow: the object store carries on
            self._end(0, f"version {version}: {one_line(e)}")
        self.store.write(version, buffer)

    def _send(self, version: int, flat: torch.Tensor) -> list:
        """Issue the version number, the buffer, then an ack every member gives once it staged the
        buffer; [] without a group."""
        g = self.group
        if g is None:
            return []
        try:
            return [
                g.broadcast(torch.tensor([version], device=flat.device), 0),
                g.broadcast(flat, 0),
                g.allreduce([torch.zeros(1, device=flat.device)]),
            ]
        except RuntimeError as e:
            self._end(0, f"version {version}: {one_line(e)}")
            return []

    # -- an engine (ranks 1..N) -------------------------------------------------------------------

    def holds(self, version: int) -> bool:
        return self.versions[version % self.slots] == version or self.store.holds(version)

    def arrivals(self) -> list[tuple[int, float, float]]:
        """The versions received since the last call: (version, t0, t1) of each one's buffer."""
        got = []
        while self.arrived:
            got.append(self.arrived.popleft())
        return got

    def read(self, version: int) -> FlatWeights:
        slot = version % self.slots
        if self.ring is not None and self.versions[slot] == version:
            return FlatWeights(self.ring[slot], self.store.layout)
        return self.store.read(version)

    def intact(self, version: int, flat: FlatWeights) -> bool:
        """Whether `flat` (from `read(version)`) still holds that version: a view into this member's ring
        whose slot a newer broadcast began to restage is not; the object store's copy always is."""
        slot = version % self.slots
        staged = self.ring is not None and flat.buffer.data_ptr() == self.ring[slot].data_ptr()
        return not staged or self.versions[slot] == version

    def _receive(self, k: int) -> None:
        """Stage every version group `k`'s trainer broadcasts, until the group ends."""
        group = self.groups[k]
        if group is None:
            return
        with self._lock:
            if self.ring is None:
                self.ring = torch.empty(self.slots, self.numel, dtype=self.store.dtype, device=self.device)
        header = torch.zeros(1, dtype=torch.long, device=self.device)
        ack = torch.zeros(1, device=self.device)
        try:
            while True:
                group.broadcast(header, 0).wait()
                version = int(header.item())
                slot = version % self.slots
                self.versions[slot] = -1  # a torn receive is never read as valid
                t0 = time.perf_counter()
                group.broadcast(self.ring[slot], 0).wait()
                if self.ring.is_cuda:  # NCCL's wait orders the device's stream, not this thread
                    torch.cuda.current_stream(self.ring.device).synchronize()
                self.versions[slot] = version
                self.arrived.append((version, t0, time.perf_counter()))
                group.allreduce([ack]).wait()
        except RuntimeError as e:  # the trainer is gone, or ended the group
            self._end(k, one_line(e))

    # -- both ---------------------------------------------------------------------------------------

    def _join(self, k: int) -> None:
        try:
            self.groups[k] = _group(*self.seats[k], self.device)
        except RuntimeError as e:
            print(f"weights: no collective ({one_line(e)}); versions go through the object store", flush=True)

    def _end(self, k: int, why: str) -> None:
        group, self.groups[k] = self.groups[k], None
        if group is not None:
            group.abort()  # closes its connections: every other member's wait ends
            print(f"weights: the collective ended ({why}); versions go through the object store", flush=True)


def _group(host: str, port: int, rank: int, world: int, gid: int, device: str) -> Any:
    """This process's member of group `gid`: gloo on this node's address, or NCCL for a CUDA device."""
    from tailrace.runtime.ray_hosts import import_ray

    dist = torch.distributed
    join = datetime.timedelta(seconds=JOIN_S)
    meet = dist.PrefixStore(
        f"tailrace-weights-{gid}", dist.TCPStore(host, port, is_master=False, timeout=join)
    )
    ops = datetime.timedelta(seconds=SEND_S if rank == 0 else WAIT_S)
    if device.startswith("cuda"):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = ops
        return dist.ProcessGroupNCCL(meet, rank, world, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=import_ray().util.get_node_ip_address())]
    opts._timeout = ops
    return dist.ProcessGroupGloo(meet, rank, world, opts)


def _start(store: StoreWeights, numel: int, seats: tuple[Place, ...], device: str) -> Member:
    """A member's end in its worker process: it joins each group in a thread (an engine's then receives)."""
    member = Member(store, numel, seats, device)
    for k, seat in enumerate(seats):
        body = partial(member._join, k) if seat[2] == 0 else partial(_join_and_receive, member, k)
        threading.Thread(target=body, name=f"weights-group{k}", daemon=True).start()
    return member


def _join_and_receive(member: Member, k: int) -> None:
    member._join(k)
    member._receive(k)
