"""`task.reward`: a task's prompts and answers, scored by a function of the user's (verl's
custom_reward_function, TRL's reward_funcs): `reward(question, response, answer) -> float`, where
`question` is the task's question text, `response` the model's answer text alone (the chat template's
markup removed) and `answer` the task's ground truth (a JSONL row's answer field). 1 or more means
verified correct: what held-out accuracy counts, in training and evaluation alike. Any other value is a
reward as it is (format bonuses, penalties: no clamping to [0, 1]).

A list of them (`UserRewards`, TRL's reward_funcs) scores by their weighted sum (task.reward_weights),
each one's value kept for the step records; `task` in the list is the task's own reward, and the first
function's 1 or more is what counts as correct.

The function runs where the task's own reward would: in the reward guard's sandboxed worker, so one that
raises, hangs or returns a non-number scores 0 with its reason counted, and the run goes on. A worker
started by spawn (Ray, or a task that asks for it) loads the function again by its spec before the
sandbox closes.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Iterator

from tailrace.tasks.base import Example, Task, TaskError
from tailrace.tasks.env import Environment
from tailrace.user_code import load_function


class UserReward(Task):
    reward_range = (-math.inf, math.inf)  # the user's own scale

    def __init__(self, task: Task, spec: str) -> None:
        _single_turn(task, spec)
        self.task, self.spec = task, spec
        self.name, self.reward_start_method = task.name, task.reward_start_method
        self.fn = load_function(spec, "task.reward")

    def __getstate__(self) -> dict:
        return {"task": self.task, "spec": self.spec}  # a function loaded from a file does not pickle

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["task"], state["spec"])

    def reward(self, example: Example, response: str) -> float:
        return self.fn(example.question, response, example.answer)

    def examples(self, split: str, n: int, seed: int = 0) -> list[Example]:
        return self.task.examples(split, n, seed)

    def difficulty(self, example: Example) -> str | None:
        return self.task.difficulty(example)

    def stream(
        self, split: str, seed: int = 0, chunk: int = 1024, size: int | None = None
    ) -> Iterator[Example]:
        return self.task.stream(split, seed, chunk, size)


class UserRewards(UserReward):
    """`task.reward` as a list (TRL's reward_funcs): each function's value (`task`: the task's own
    reward) is kept (`Scored.parts`, logged per step by name) and their sum by `weights` is the reward;
    the first one's value of 1 or more is what counts as correct. The guard scores each function on its
    own (`part_fns`), so one that raises counts 0 with its reason and the others stand."""

    def __init__(self, task: Task, specs: list[str], weights: list[float] | None = None) -> None:
        _single_turn(task, specs)
        self.task, self.name, self.reward_start_method = task, task.name, task.reward_start_method
        self.specs, self.weights = list(specs), [float(w) for w in weights or [1.0] * len(specs)]
        fns = {s: load_function(s, "task.reward") for s in dict.fromkeys(specs) if s != "task"}
        self.part_fns = [task.reward if s == "task" else partial(_call_users, fns[s]) for s in self.specs]
        names = [s if s == "task" else s.rpartition(":")[2] for s in self.specs]
        self.part_names = tuple(
            n if names.index(n) == i else f"{n}_{i + 1}" for i, n in enumerate(names)
        )  # a name given twice: the later ones by their place

    def __getstate__(self) -> dict:
        return {"task": self.task, "specs": self.specs, "weights": self.weights}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["task"], state["specs"], state["weights"])

    def combine(self, parts: list[float]) -> float:
        return sum(w * p for w, p in zip(self.weights, parts))

    def reward(self, example: Example, response: str) -> float:
        return self.combine([fn(example, response) for fn in self.part_fns])


def _single_turn(task: Task, spec: str | list[str]) -> None:
    if isinstance(task, Environment):
        raise TaskError(
            f"task.reward={spec} with task.name={task.name}: a multi-turn task's reward is its own; "
            "drop task.reward"
        )


def _call_users(fn, example: Example, response: str) -> float:
    return fn(example.question, response, example.answer)
