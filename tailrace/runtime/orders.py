"""The train orders since the trainer's last checkpoint: what a replacement trainer redoes.

A trainer lost mid-run (runtime/recovery.py) is replaced by one that starts from the newest whole
checkpoint, so it must redo every step since: the steps the driver already counted as `replay` orders
(the optimizer moves; nothing is published or saved again), then the steps still owed, as they were
ordered. The orders hold their groups, so nothing is read back from the journal. Orders issued while
the replacement starts wait behind the replayed ones: the trainer takes its orders in step order.
"""

from __future__ import annotations

from dataclasses import replace

from tailrace.runtime.messages import TrainOrder


class TrainOrders:
    def __init__(self) -> None:
        self._kept: dict[int, TrainOrder] = {}  # step -> its order, for steps after the last checkpoint
        self._backlog: list[TrainOrder] | None = None  # while a replacement trainer starts

    def add(self, order: TrainOrder) -> TrainOrder | None:
        """Keep `order`; returns it to send now, or None while a replacement starts (it waits)."""
        self._kept[order.train.step] = order
        if self._backlog is None:
            return order
        self._backlog.append(order)
        return None

    def checkpointed(self, steps: int) -> None:
        """A checkpoint holds the trainer after `steps` steps: the orders before it are done with."""
        self._kept = {s: o for s, o in self._kept.items() if s >= steps}

    def restart(self, steps_done: int) -> int:
        """A replacement trainer starts from the last checkpoint: queue every kept order again, those
        of the `steps_done` already counted as replays. Returns how many steps it replays."""
        redo = [self._kept[s] for s in sorted(self._kept)]
        self._backlog = [
            replace(o, save_dir=None, replay=True) if o.train.step < steps_done else o for o in redo
        ]
        return sum(o.replay for o in self._backlog)

    def ready(self) -> list[TrainOrder]:
        """The replacement is up: the orders to send it, in step order."""
        backlog, self._backlog = self._backlog or [], None
        return backlog
