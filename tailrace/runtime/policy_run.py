"""`PolicyRun`: one policy's part of a run — its scheduler, task, trainer process and files.

A run trains one policy, or several sharing the rollout engines (`policies` in the config;
flow/multi.py's `PolicySet` holds their schedulers). Each policy has what the driver keeps per
trainer: the scheduler (its mode, staleness bound, versions, ledger), the session (task, prompts,
rewards, held-out set; a multi-turn task's environment, whose tools answer the policy's samples), the
trainer process and the train orders a replacement of it redoes, its checkpoint cadence, the groups of
each step in training, and its files. One policy writes them at the
top of the run directory as always; several write each under `policies/<name>/` (metrics.jsonl,
journal.jsonl, events.jsonl with its scheduler's marks, checkpoints/), and the run's engine timeline
and recoveries go to the top-level events.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tailrace.config import RunConfig, TrainerConfig
from tailrace.flow.scheduler import Scheduler
from tailrace.records import EvalRecord
from tailrace.runtime import checkpoint
from tailrace.runtime.metrics import Utilization
from tailrace.runtime.orders import TrainOrders
from tailrace.runtime.rundir import RecordFile, RunDir
from tailrace.runtime.snapshots import Snapshots
from tailrace.runtime.trainer_worker import TrainerSpec
from tailrace.runtime.workers import Worker
from tailrace.types import Trajectory

if TYPE_CHECKING:
    from tailrace.runtime.evaluate import Evaluator
    from tailrace.runtime.session import Session


@dataclass
class PolicyRun:
    name: str  # "" when the run has one policy
    index: int  # p: its versions are engine versions v * S + p (S: the run's room for policies)
    cfg: RunConfig  # the run's config with the policy's own sections
    sched: Scheduler
    ses: Session
    train_cfg: TrainerConfig  # with the mode's own correction
    run: RunDir  # where its files go
    cadence: checkpoint.Cadence
    snapshots: Snapshots
    metrics: RecordFile = field(init=False)
    journal: RecordFile = field(init=False)
    marks: RecordFile | None = None  # its scheduler's marks (None: the run's events.jsonl)
    orders: TrainOrders = field(default_factory=TrainOrders)
    # step -> (the version it starts from, its trajectories), while it trains
    pending_trajs: dict[int, tuple[int, list[Trajectory]]] = field(default_factory=dict)
    saved_versions: dict[int, Path] = field(default_factory=dict)  # its version -> a checkpoint holding it
    restart_from: Path | None = None  # its newest whole checkpoint
    last_wall: float = 0.0  # the newest step record's wall_s: when its newest weights were published
    # its step records' time figures, each over the window since its previous record: the shared
    # engines' (every policy's windows get them) and its own trainer's; the driver's CPU likewise
    util: Utilization | None = None
    cpu_mark: float = 0.0
    tool_errors: int = 0  # its tool calls that failed since its last step record (multi-turn tasks)
    trainer: Worker | None = None
    tspec: TrainerSpec | None = None
    evaluator: Evaluator | None = None  # its held-out set (None: eval.n = 0)
    base: EvalRecord | None = None  # its base evaluation
    leaving: bool = False  # asked to leave (tailrace policy leave): its next step is its last

    def __post_init__(self) -> None:
        self.metrics = RecordFile(self.run.file("metrics.jsonl"))
        self.journal = RecordFile(self.run.file("journal.jsonl"))

    @property
    def worker_name(self) -> str:
        return f"trainer-{self.name}" if self.name else "trainer"

    def close(self) -> None:
        for f in (self.metrics, self.journal, self.marks):
            if f is not None:
                f.close()
