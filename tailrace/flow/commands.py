"""What the scheduler tells the world to do. The local runtime and the simulator both execute these.

Commands are decisions, not requests for information: each is final once emitted, and the scheduler
has already updated its own books (in-flight counts, ledger) as if it had happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.types import Group, Prompt


@dataclass(frozen=True)
class Sample:
    """One response to generate: sample `index` of group `group` under weights `version`.

    `resume_*` carry an aborted partial (partial rollout); its tokens keep their own versions.
    """

    id: str
    group: int
    index: int
    prompt: Prompt
    version: int
    resume_ids: tuple[int, ...] = ()
    resume_logprobs: tuple[float, ...] = ()
    resume_versions: tuple[int, ...] = ()


@dataclass(frozen=True)
class Generate:
    engine: int
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class Abort:
    """Stop these samples; the engine returns their partials (finish = aborted)."""

    engine: int
    sample_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Train:
    """One optimizer step over `groups`. When `publish` is set, the trainer publishes its weights as
    that version after the step (and the runtime reports `on_published`)."""

    step: int
    groups: tuple[Group, ...]
    trainer_version: int  # the version of the weights this step starts from
    publish: int | None


@dataclass(frozen=True)
class LoadWeights:
    engine: int
    version: int


@dataclass(frozen=True)
class DropWeights:
    engine: int
    version: int


Command = Generate | Abort | Train | LoadWeights | DropWeights
