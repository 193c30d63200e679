"""make_task: a Task from a spec string — "chainsum", "gym:<dataset>", "jsonl:<path>" or "code:<path>".

Each kind is imported only when asked for: reasoning-gym alone takes over a second to import.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping

from tailrace.tasks.base import Task, TaskError, check_config

FORMS = (
    "'chainsum' (built-in default), 'chaincalc' (chainsum with a calculator: multi-turn), "
    "'gym:<reasoning-gym dataset>' (e.g. gym:basic_arithmetic), "
    "'jsonl:<path to .jsonl>', 'parquet:<path to .parquet>' (the same rows: Hugging Face datasets' and "
    "verl's files) or 'code:<path to .jsonl of prompts and tests>'"
)


def make_task(
    spec: str,
    config: Mapping[str, Any] | None = None,
    max_turns: int = 32,
    reward: str | list[str] | None = None,
    reward_weights: list[float] | None = None,
) -> Task:
    """`config` (task.config): the task's own settings, checked key by key — chainsum's spec fields
    that shape its questions, a reasoning-gym dataset's config, or the keyword options of JsonlTask
    and CodeTask. `max_turns` (task.max_turns): a multi-turn task's turns per episode at most.
    `reward` (task.reward): the user's function, or functions summed by `reward_weights`, that score it
    instead of its own (tasks/user_reward)."""
    task = _make_task(spec, config, max_turns)
    if reward is None:
        return task
    from tailrace.tasks.user_reward import UserReward, UserRewards

    if isinstance(reward, str):
        return UserReward(task, reward)
    return UserRewards(task, list(reward), reward_weights)


def _make_task(spec: str, config: Mapping[str, Any] | None, max_turns: int) -> Task:
    kind, sep, arg = spec.partition(":")
    config = config or {}
    if spec == "chainsum":
        from tailrace.tasks.chainsum import ChainSumSpec, ChainSumTask

        return ChainSumTask(ChainSumSpec.from_config(config))
    if spec == "chaincalc":
        from tailrace.tasks.chaincalc import ChainCalcTask

        return ChainCalcTask.from_config(config, max_turns)
    if sep and kind == "gym":
        from tailrace.tasks.gym import ReasoningGymTask

        return ReasoningGymTask(arg, config=config)
    if sep and kind in ("jsonl", "parquet", "code"):
        if not arg:
            ext = "parquet" if kind == "parquet" else "jsonl"
            raise TaskError(f"task spec '{kind}:' has no path; write {kind}:<path to .{ext}>")
        if kind in ("jsonl", "parquet"):
            from tailrace.tasks.jsonl import JsonlTask as cls
        else:
            from tailrace.tasks.code import CodeTask as cls
        options = _options(spec, cls, config)
        try:
            return cls(arg, **options)
        except TypeError as e:  # a value of the wrong type, met by the task's own checks
            raise TaskError(f"{spec}: bad task.config {dict(config)}: {e}; fix the value's type") from None
    raise TaskError(f"unknown task spec {spec!r}; use {FORMS}")


def multi_turn(spec: str) -> bool:
    """Whether the task of `spec` is an `Environment` (tool calls between turns), known from its name
    alone (without importing it)."""
    return spec == "chaincalc"


def _options(spec: str, cls: type, config: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor's keyword-only options named in `config`; a mapping given for an option whose
    default is a dataclass (CodeTask's sandbox) builds that dataclass."""
    params = {p.name: p for p in inspect.signature(cls).parameters.values() if p.kind is p.KEYWORD_ONLY}
    options = check_config(spec, config, list(params))
    for k, v in options.items():
        default = params[k].default
        if dataclasses.is_dataclass(default) and isinstance(v, Mapping):
            fields = [f.name for f in dataclasses.fields(default)]
            sub = check_config(f"{spec} {k}", v, fields)
            sub = {f: tuple(x) if isinstance(x, list) else x for f, x in sub.items()}  # YAML lists
            try:
                options[k] = dataclasses.replace(default, **sub)
            except (TypeError, ValueError) as e:
                raise TaskError(f"{spec}: bad task.config {k} {dict(v)}: {e}") from None
    return options
