"""make_task: a Task from a spec string — "chainsum", "gym:<reasoning-gym dataset>" or "jsonl:<path>".

Each kind is imported only when asked for: reasoning-gym alone takes over a second to import.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from tailrace.tasks.base import Task, TaskError, check_config

FORMS = (
    "'chainsum' (built-in default), 'gym:<reasoning-gym dataset>' (e.g. gym:basic_arithmetic) "
    "or 'jsonl:<path to .jsonl>'"
)


def make_task(spec: str, config: Mapping[str, Any] | None = None) -> Task:
    """`config` (task.config): the task's own settings, checked key by key — chainsum's spec fields
    that shape its questions, a reasoning-gym dataset's config, or JsonlTask's options."""
    kind, sep, arg = spec.partition(":")
    config = config or {}
    if spec == "chainsum":
        from tailrace.tasks.chainsum import ChainSumSpec, ChainSumTask

        return ChainSumTask(ChainSumSpec.from_config(config))
    if sep and kind == "gym":
        from tailrace.tasks.gym import ReasoningGymTask

        return ReasoningGymTask(arg, config=config)
    if sep and kind == "jsonl":
        if not arg:
            raise TaskError("task spec 'jsonl:' has no path; write jsonl:<path to .jsonl>")
        from tailrace.tasks.jsonl import JsonlTask

        params = inspect.signature(JsonlTask).parameters.values()
        options = check_config(spec, config, [p.name for p in params if p.kind is p.KEYWORD_ONLY])
        try:
            return JsonlTask(arg, **options)
        except TypeError as e:  # a value of the wrong type, met by the task's own checks
            raise TaskError(f"{spec}: bad task.config {options}: {e}; fix the value's type") from None
    raise TaskError(f"unknown task spec {spec!r}; use {FORMS}")
