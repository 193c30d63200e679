"""What the driver and its worker processes say to each other, besides the scheduler's commands
(Generate / Abort / LoadWeights / DropWeights go to engines as they are; Train goes to the trainer
inside a `TrainOrder`). Every message is one of these records: no tuples, no sentinels."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailrace.engine.events import StepEvent
from tailrace.engine.spec.drafter import Trained
from tailrace.flow.commands import Train
from tailrace.types import GenResult


@dataclass(frozen=True)
class Ready:
    """A worker finished starting up, holding weights `version`."""

    version: int


@dataclass(frozen=True)
class Beat:
    """A heartbeat where the driver shares no memory with the worker (Ray), on a connection of its own
    so it is heard whatever the driver is reading: the count so far (runtime/health.py)."""

    count: int


@dataclass(frozen=True)
class Go:
    """To an engine started with `EngineSpec.gated`: the trainer is up, so the engine may load its
    model and size its KV memory from what is left (its imports already ran meanwhile)."""


@dataclass(frozen=True)
class Shutdown:
    """The driver is done with this worker: it exits its loop."""


@dataclass(frozen=True)
class Failed:
    """A worker's exception, sent just before the worker exits."""

    kind: str  # the exception's type name
    message: str  # its message's first line
    input: bool  # bad input (a `common.InputError`: a corrupt checkpoint, ...) rather than a fault
    details: str  # the traceback, for the run's errors.log


@dataclass
class Stats:
    """Engine step statistics accumulated between two reports."""

    steps: int = 0
    busy_s: float = 0.0
    slot_s: float = 0.0  # sum over steps of occupied slots (decoding or prefilling) x step duration
    decode_tokens: int = 0
    prefill_tokens: int = 0
    spans: list[tuple[float, float]] = field(default_factory=list)  # merged busy intervals
    spec: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # see `add_spec`
    spec_versions: dict[int, list[int]] = field(default_factory=dict)  # version -> [drafted, accepted]
    train: tuple[int, float] = (0, 0.0)  # a trained drafter's optimizer steps and seconds, in idle time

    def add_spec(self, ev: StepEvent) -> None:
        """A step's speculative decoding: decode rows, rows that verified a draft, draft tokens, accepted
        (in all and per policy version)."""
        for i, n in enumerate((ev.active, ev.verifies, ev.drafted, ev.accepted)):
            self.spec[i] += n
        for v, d, a in ev.by_version:
            c = self.spec_versions.setdefault(v, [0, 0])
            c[0] += d
            c[1] += a

    def add_training(self, done: Trained) -> None:
        self.train = (self.train[0] + done.steps, self.train[1] + done.seconds)

    def add(self, t0: float, dt: float, active: int, prefill: int, decode: int) -> None:
        self.steps += 1
        self.busy_s += dt
        self.slot_s += active * dt
        self.decode_tokens += decode
        self.prefill_tokens += prefill
        if self.spans and t0 - self.spans[-1][1] < 2e-3:  # merge back-to-back steps into one span
            self.spans[-1] = (self.spans[-1][0], t0 + dt)
        else:
            self.spans.append((t0, t0 + dt))


@dataclass
class EngineReport:
    """What an engine finished since its last report, with its step statistics and weight loads."""

    engine: int
    results: list[GenResult]
    stats: Stats
    loaded: list[tuple[int, float, float]]  # (version, t0, t1) weight loads since the last report
    t: float
    received: list[tuple[int, float, float]] = field(default_factory=list)  # (version, t0, t1) weights
    # that reached the engine's own ring meanwhile (a collective's receive; none from a shared ring)
    missed: list[int] = field(default_factory=list)  # versions it was asked to load whose weights were
    # gone when it read them (`weights.VersionGone`): it holds what it held


@dataclass(frozen=True)
class History:
    """Finished responses to draft from (speculative decoding): `(prompt ids, response ids)` pairs,
    forwarded from the engine that generated them to the others."""

    responses: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


@dataclass(frozen=True)
class TrainOrder:
    train: Train
    save_dir: str | None = None  # write a checkpoint there after the step
    merged: bool = True  # a LoRA trainer's checkpoint holds model/ (merged) too, not only adapter/
    replay: bool = False  # redo a step the driver already counted: neither publish nor save


@dataclass
class TrainerReport:
    step: int
    metrics: dict
    published: int | None
    saved: str | None  # the checkpoint directory the trainer wrote its part of
    span: tuple[float, float]  # the step's compute
    sync_span: tuple[float, float] | None  # copying weights into shared memory
    save_s: float = 0.0  # writing its part of the checkpoint
    replay: bool = False  # the step of a replay order: already counted
