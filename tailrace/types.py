"""Records that cross component boundaries. Plain, typed, immutable once complete; no torch.

Engine-level records (`SamplingParams`, `GenRequest`, `GenResult`) know nothing of RL: token ids in,
token ids + logprobs + versions out. RL records (`Prompt`, `Scored`, `Trajectory`, `Group`) wrap them.
"""

from __future__ import annotations

from collections.abc import Callable, MutableSequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

T = TypeVar("T")


class Finish(str, Enum):
    STOP = "stop"  # sampled a stop token
    LENGTH = "length"  # hit max_new_tokens or the context limit
    ABORTED = "aborted"  # taken out by abort(); the result is a partial


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_new_tokens: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # per-request generator seed; None = engine's stream

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(
                f"temperature={self.temperature} is negative; use 0 for greedy or a positive value"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to turn nucleus sampling off")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} is negative; use 0 to turn top-k off")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} must lie in [0, max_new_tokens={self.max_new_tokens}]"
            )


@dataclass(frozen=True)
class Capabilities:
    """What an engine supports; scheduling policies read this, never an engine's name. Here, not in
    `engine.protocol`, because the scheduler (pure: no torch, no engine) reads it too."""

    # `abort` returns the partial trajectory, and a request carrying it (`GenRequest.resume_*`)
    # continues it with the tokens it would have drawn uninterrupted.
    abort_resume: bool
    # how many weight versions it holds and serves in one step; None: any number (memory permitting).
    # 1: `load_weights` of another version replaces the one held, and only once no request of that
    # one is waiting or running (the scheduler waits for the engine to drain; see `Scheduler.load`)
    versions_at_once: int | None
    # a request's `SamplingParams.seed` fixes its tokens whatever else is in the batch
    per_request_seed: bool
    # speculative decoding (lossless: the same tokens as without it)
    speculative: bool
    # LoRA adapters (`load_adapter`, `GenRequest.adapter`): rows of several adapters share one forward
    adapters: bool = False


@dataclass(frozen=True)
class GenRequest:
    """One sequence to generate. `resume_*` continue an aborted partial (tokens keep their versions)."""

    id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    version: int = 0
    resume_ids: tuple[int, ...] = ()
    resume_logprobs: tuple[float, ...] = ()
    resume_versions: tuple[int, ...] = ()
    adapter: str = ""  # the LoRA adapter on top (a name the engine's `load_adapter` was given); "" = none
    # the engine admits waiting requests lowest first, in arrival order among equals (() for all: FIFO);
    # several policies in one run stamp (when the policy's oldest open group opened, policy): flow/multi.py
    priority: tuple[float, ...] = ()
    # routing replay: the aborted partial's (or finished turn's) routes (`GenResult.routes`): the positions
    # whose next token was drawn before keep the experts chosen when it was drawn, not those of the
    # re-prefill under this request's version
    resume_routes: bytes = field(default=b"", repr=False)


def queue_by_priority(queue: MutableSequence[T], item: T, priority: Callable[[T], tuple]) -> None:
    """Put `item` in a waiting queue kept in `GenRequest.priority` order: after every waiting item of
    the same or a lower priority (arrival order among equals; all equal: a FIFO)."""
    p = priority(item)
    if not queue or priority(queue[-1]) <= p:
        queue.append(item)
        return
    at = next(i for i, x in enumerate(queue) if priority(x) > p)
    queue.insert(at, item)


@dataclass(frozen=True)
class GenResult:
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # log-prob of each sampled token under the distribution it was sampled from
    versions: tuple[int, ...]  # policy version that produced each token
    finish: Finish
    submitted: float = 0.0  # engine clock, seconds
    first_token: float = 0.0
    finished: float = 0.0
    # routing replay (model/moe.py): the experts each position's forward chose, positions [0, prompt +
    # tokens - 1) x sparse layers x k as uint8; b"": not recorded (a dense model, replay off, a journal)
    routes: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class Prompt:
    id: int
    token_ids: tuple[int, ...]
    answer: str  # ground-truth handle the task's reward understands
    text: str = ""


@dataclass(frozen=True)
class Scored:
    """The reward of one finished (not aborted) engine result, computed by whoever knows text."""

    request_id: str
    reward: float
    correct: bool


@dataclass(frozen=True)
class Trajectory:
    """A finished (or aborted) sample of group `group`; `reward` is 0 for an aborted partial."""

    group: int
    sample_index: int
    prompt_id: int
    prompt_ids: tuple[int, ...]
    result: GenResult
    reward: float
    correct: bool
    dispatch_version: int = 0  # version the request was dispatched under
    # multi-turn (tasks/env.py): [start, end) of the response's observation tokens (tool answers:
    # conditioned on, never trained on; the trainer's loss mask), and the seconds it waited on tools
    observed: tuple[tuple[int, int], ...] = ()
    tool_s: float = 0.0

    @property
    def versions(self) -> tuple[int, ...]:
        return self.result.versions

    @property
    def oldest_version(self) -> int:
        return min(self.result.versions) if self.result.versions else self.dispatch_version

    @property
    def length(self) -> int:
        return len(self.result.token_ids)

    @property
    def truncated(self) -> bool:
        """Cut off at the length limit: its length says nothing of the answer's (shaping excludes it)."""
        return self.result.finish == Finish.LENGTH


@dataclass(frozen=True)
class Group:
    id: int
    prompt_id: int
    trajectories: tuple[Trajectory, ...]
    advantages: tuple[float, ...] = field(default=())  # filled by the trainer's estimator when empty
