"""Which lost workers the driver may restart, and the record of each restart.

A worker lost while the run goes (it died, or was stuck and killed: runtime/health.py) is restarted at
most `max_restarts` times within any hour; a worker lost more often than that has a cause a restart
will not fix, and the run stops in one line as it does with `max_restarts=0`. A restart is open from
the loss until the replacement says Ready; it then becomes a `recovery` mark in events.jsonl: the
worker, the cause, the downtime (loss to Ready), the samples requeued (an engine) or the optimizer
steps replayed (the trainer). Time is passed in. A replacement engine loads the versions its
predecessor held from the shared-memory ring, or from a checkpoint for one the ring has recycled
(`weights_on_disk`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tailrace.records import Mark
from tailrace.runtime.health import Lost

WINDOW_S = 3600.0  # max_restarts counts the restarts of one worker within this window


@dataclass
class Restart:
    lost: Lost
    t_lost: float
    requeued: int = 0  # samples an engine had in flight, dispatched again
    replayed: int = 0  # steps the trainer redoes from its last checkpoint


class Recovery:
    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self._times: dict[str, list[float]] = {}  # worker -> when it was restarted, within the window
        self._open: dict[str, Restart] = {}  # worker -> its restart, until the replacement is Ready

    @property
    def restarting(self) -> list[str]:
        """Workers whose replacement has not said Ready yet."""
        return list(self._open)

    def allows(self, lost: Lost, now: float) -> bool:
        recent = [t for t in self._times.get(lost.worker, []) if now - t < WINDOW_S]
        self._times[lost.worker] = recent
        return len(recent) < self.max_restarts

    def restarts(self, worker: str, now: float) -> int:
        """`worker`'s restarts within the window."""
        return sum(1 for t in self._times.get(worker, []) if now - t < WINDOW_S)

    def refusal(self, lost: Lost) -> str:
        """The fault's line when `allows` said no."""
        if self.max_restarts == 0:
            return lost.line
        return (
            f"{lost.line}, after {self.max_restarts} restarts within the hour (max_restarts="
            f"{self.max_restarts}): a restart will not fix that; see the worker's output above"
        )

    def begin(self, lost: Lost, now: float, requeued: int = 0, replayed: int = 0) -> None:
        """A replacement for `lost.worker` is starting. A replacement lost before Ready extends the
        restart that brought it (its downtime runs from the first loss)."""
        self._times.setdefault(lost.worker, []).append(now)
        prev = self._open.get(lost.worker)
        t_lost = prev.t_lost if prev else now
        requeued += prev.requeued if prev else 0
        self._open[lost.worker] = Restart(lost, t_lost, requeued, replayed)

    def ready(self, worker: str, now: float) -> Mark | None:
        """The `recovery` mark of `worker`'s restart, now that its replacement is Ready (None if it
        was not restarting)."""
        r = self._open.pop(worker, None)
        if r is None:
            return None
        data = {
            "worker": worker, "cause": r.lost.cause, "detail": r.lost.line,
            "downtime_s": round(now - r.t_lost, 3), "requeued": r.requeued, "replayed": r.replayed,
            "restarts": len(self._times[worker]),
        }  # fmt: skip
        return Mark(now, "recovery", data)


def describe(m: Mark) -> str:
    """A recovery mark as the console's one line."""
    d = m.data
    if d["worker"] == "driver":
        what = f"resumed from its last checkpoint, {d['replayed']} steps redone"
    elif d["worker"] == "trainer" or d["worker"].startswith("trainer-"):  # (a policy's, of several)
        what = f"{d['replayed']} steps replayed from its last checkpoint"
    else:
        what = f"{d['requeued']} samples requeued"
    return f"recovered: {d['detail']}; restarted in {d['downtime_s']:.1f} s, {what}"


def saved_versions(root: Path) -> dict[int, Path]:
    """{version: a whole kept checkpoint holding its weights} of the run's checkpoints under `root`."""
    from tailrace.runtime import checkpoint

    out: dict[int, Path] = {}
    for d in reversed(checkpoint.step_dirs(root)):  # oldest first: the newest holding a version wins
        if checkpoint.verify(d) is None:
            try:
                out[json.loads((d / checkpoint.SCHEDULER).read_text())["version"]] = d
            except (OSError, ValueError, KeyError):
                continue
    return out


def weights_on_disk(
    versions: list[int], in_ring: Callable[[int], bool], saved: dict[int, Path], model: int | None = 0
) -> tuple[dict[int, Path], list[int]]:
    """Of `versions`, those the ring no longer holds: {version: the checkpoint holding its weights},
    and those no kept checkpoint holds either. `model`, the version that is the engines' own model
    (0, the first policy's start; None: none of these), needs neither."""
    gone = [v for v in versions if v != model and not in_ring(v)]
    disk = {v: saved[v] for v in gone if v in saved and saved[v].is_dir()}  # is_dir: not pruned since
    return disk, [v for v in gone if v not in disk]
