"""The Task protocol: prompts in, rewards out. A task knows text; the tokenizer turns it into ids.

A task is deterministic given its seed: `examples("train")` and `examples("test")` are disjoint,
reproducible streams. `reward(example, response)` scores one response text; it may be slow,
buggy or hostile (user code), so the runtime always calls it through `tasks.guard.RewardGuard`, which
sandboxes it and clamps its value into the task's declared `reward_range`.
"""

from __future__ import annotations

import difflib
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping

from tailrace.common import InputError

SPLITS = ("train", "test")


class TaskError(InputError):
    """A task cannot be built or read. The message is one line: what is wrong and how to fix it."""


@dataclass(frozen=True)
class Example:
    id: int
    question: str  # text fed to the model (already in the task's prompt format); of chat messages, the last
    answer: str  # ground truth the reward understands
    # a conversational prompt (a JSONL row's list of {role, content} messages, as TRL's datasets hold
    # them): (role, content) pairs that go through the model's chat template as they are; () = `question`
    # alone as the user's turn
    messages: tuple[tuple[str, str], ...] = ()


class Task(ABC):
    name: str = "task"
    reward_range: tuple[float, float] = (0.0, 1.0)  # (low, high): the guard clamps rewards into it
    # how the guard starts the reward worker: None forks it from the trainer (cheap to start, but as
    # large as the trainer); "spawn" starts a fresh interpreter, for rewards that fork on every call
    reward_start_method: str | None = None

    @abstractmethod
    def examples(self, split: str, n: int, seed: int = 0) -> list[Example]:
        """n examples of `split` ("train" or "test"); the same arguments give the same list."""

    @abstractmethod
    def reward(self, example: Example, response: str) -> float:
        """Score of one response in `reward_range`; with the default [0, 1], 1 means verified correct."""

    def difficulty(self, example: Example) -> str | None:
        """A difficulty bucket for held-out accuracy by bucket (None: the task has none)."""
        return None

    def stream(
        self, split: str, seed: int = 0, chunk: int = 1024, size: int | None = None
    ) -> Iterator[Example]:
        """An endless stream of examples for RL prompt queues: fresh chunks with ids continuing, or,
        with `size`, the same `size` examples over and over (epochs: a prompt and its id come back)."""
        if size is not None:
            epoch = self.examples(split, size, seed=seed)
            while True:
                yield from epoch
        base = 0
        while True:
            for ex in self.examples(split, chunk, seed=seed + base):
                yield replace(ex, id=base + ex.id)
            base += chunk


def stable_hash(text: str) -> int:
    """A 32-bit hash of `text` that every machine and Python run agrees on (splits, derived seeds)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def in_test_split(question: str, test_mod: int) -> bool:
    """Whether `question` is held out: one question in `test_mod`, chosen by its hash, so the train
    and test splits never share a question and a question never changes sides."""
    return stable_hash(question) % test_mod == 0


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise TaskError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")


def check_config(task: str, config: Mapping[str, Any], valid: list[str]) -> dict[str, Any]:
    """`config` (task.config) as a dict, once every key is one of `valid`; else one line naming them."""
    for key in config:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise TaskError(f"{task}: unknown task.config key {key!r}; {hint}valid keys: {', '.join(valid)}")
    return dict(config)
