"""What the scheduler tells the world to do. The local runtime and the simulator both execute these.

Commands are decisions, not requests for information: each is final once emitted, and the scheduler
has already updated its own books (in-flight counts, ledger) as if it had happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.types import GenRequest, Group


@dataclass(frozen=True)
class Generate:
    """Queue these requests on an engine (the engine's own record: the scheduler builds it once)."""

    engine: int
    requests: tuple[GenRequest, ...]


@dataclass(frozen=True)
class Abort:
    """Stop these requests; the engine returns their partials (finish = aborted)."""

    engine: int
    request_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Train:
    """One optimizer step over `groups`. When `publish` is set, the trainer publishes its weights as
    that version after the step (and the runtime reports `on_published`)."""

    step: int
    groups: tuple[Group, ...]
    trainer_version: int  # the version of the weights this step starts from
    publish: int | None
    policy: int = (
        0  # whose trainer (several policies in one run: flow/multi.py); steps and versions are its own
    )


@dataclass(frozen=True)
class LoadWeights:
    engine: int
    version: int


@dataclass(frozen=True)
class DropWeights:
    engine: int
    version: int


Command = Generate | Abort | Train | LoadWeights | DropWeights
