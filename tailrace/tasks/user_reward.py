"""`task.reward`: a task's prompts and answers, scored by a function of the user's (verl's
custom_reward_function, TRL's reward_funcs): `reward(question, response, answer) -> float`, where
`question` is the task's question text, `response` the model's answer text alone (the chat template's
markup removed) and `answer` the task's ground truth (a JSONL row's answer field). 1 or more means
verified correct: what held-out accuracy counts, in training and evaluation alike. Any other value is a
reward as it is (format bonuses, penalties: no clamping to [0, 1]).

The function runs where the task's own reward would: in the reward guard's sandboxed worker, so one that
raises, hangs or returns a non-number scores 0 with its reason counted, and the run goes on. A worker
started by spawn (Ray, or a task that asks for it) loads the function again by its spec before the
sandbox closes.
"""

from __future__ import annotations

import math
from typing import Iterator

from tailrace.tasks.base import Example, Task, TaskError
from tailrace.tasks.env import Environment
from tailrace.user_code import load_function


class UserReward(Task):
    reward_range = (-math.inf, math.inf)  # the user's own scale

    def __init__(self, task: Task, spec: str) -> None:
        if isinstance(task, Environment):
            raise TaskError(
                f"task.reward={spec} with task.name={task.name}: a multi-turn task's reward is its own; "
                "drop task.reward"
            )
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
