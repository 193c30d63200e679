"""make_task: a Task from a spec string — "chainsum", "gym:<dataset>", "jsonl:<path>" or "code:<path>".

Each kind is imported only when asked for: reasoning-gym alone takes over a second to import.
"""

from __future__ import annotations

from tailrace.tasks.base import Task, TaskError

FORMS = (
    "'chainsum' (built-in default), 'gym:<reasoning-gym dataset>' (e.g. gym:basic_arithmetic), "
    "'jsonl:<path to .jsonl>' or 'code:<path to .jsonl of prompts and tests>'"
)


def make_task(spec: str, **kwargs) -> Task:
    """kwargs go to the task's constructor (ChainSumTask, ReasoningGymTask, JsonlTask or CodeTask)."""
    kind, sep, arg = spec.partition(":")
    if spec == "chainsum":
        from tailrace.tasks.chainsum import ChainSumTask

        return ChainSumTask(**kwargs)
    if sep and kind == "gym":
        from tailrace.tasks.gym import ReasoningGymTask

        return ReasoningGymTask(arg, **kwargs)
    if sep and kind == "jsonl":
        if not arg:
            raise TaskError("task spec 'jsonl:' has no path; write jsonl:<path to .jsonl>")
        from tailrace.tasks.jsonl import JsonlTask

        return JsonlTask(arg, **kwargs)
    if sep and kind == "code":
        if not arg:
            raise TaskError("task spec 'code:' has no path; write code:<path to .jsonl>")
        from tailrace.tasks.code import CodeTask

        return CodeTask(arg, **kwargs)
    raise TaskError(f"unknown task spec {spec!r}; use {FORMS}")
