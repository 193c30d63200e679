"""Configuration: one small dataclass per component, composed into `RunConfig`.

Each dataclass validates itself in `__post_init__` and names the field and the fix. YAML files and
`--section.key=value` overrides map onto the dataclasses mechanically (`load_config`); an unknown
key or a value of the wrong type is a `ConfigError` before any process starts. No torch here.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tailrace.errors import ConfigError
from tailrace.trainer.config import LossConfig, TrainerConfig

__all__ = ["ConfigError", "LossConfig", "TrainerConfig", "RunConfig", "load_config", "dump_config"]


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


@dataclass
class ModelSpec:
    path: str | None = None  # a local HF checkpoint dir; None = the built-in warm-started default
    dtype: str = "float32"  # float32 | bfloat16

    def __post_init__(self) -> None:
        _need(self.dtype in ("float32", "bfloat16"), f"model.dtype={self.dtype!r}: use float32 or bfloat16")


@dataclass
class TaskConfig:
    name: str = "chainsum"  # chainsum | gym:<reasoning_gym name> | jsonl:<path>
    reward_timeout_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        _need(
            self.reward_timeout_s > 0, f"task.reward_timeout_s={self.reward_timeout_s}: must be > 0 seconds"
        )


@dataclass
class SFTConfig:
    """The warm-start recipe. Its hash names the cache entry, so a changed recipe rebuilds.

    The default model is small on purpose (0.8M parameters, hidden 128, 4 layers): on two CPU cores
    it crosses chainsum's learning transition (finding each term by its letter) in ~1,500 small
    steps and is past it by ~2,700 (30,000 demonstrations, under 5 minutes), a point a 2.4M
    hidden-256 model reaches far later here (3.9% after 900 steps vs 23%). One demonstration step in
    five carries a slip (a sum off by one, carried on): the warm-started policy then makes the
    mistakes a real base model makes, lands at ~40% accuracy, and GRPO has errors to remove that
    compound over long chains. Without slips it lands higher with less to gain (53% at 15% slips).
    """

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_len: int = 512
    examples: int = 30000
    slip: float = 0.2  # chance that a demonstration step's sum is off by one (carried on to the answer)
    batch_tokens: int = 1024  # tokens per optimizer step (length-bucketed): many small steps learn fastest
    epochs: int = 1
    lr: float = 2e-3
    warmup: int = 100
    seed: int = 0
    threads: int = 2
    bf16: bool = True  # autocast the forward to bfloat16 (weights stay fp32)

    def __post_init__(self) -> None:
        for k in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_len",
            "examples",
            "batch_tokens",
            "epochs",
            "threads",
        ):
            _need(getattr(self, k) > 0, f"sft.{k}={getattr(self, k)}: must be positive")
        _need(0.0 <= self.slip < 1.0, f"sft.slip={self.slip}: must be in [0, 1)")
        _need(
            self.hidden_size % self.num_heads == 0,
            f"sft.hidden_size={self.hidden_size} is not divisible by sft.num_heads={self.num_heads}",
        )
        _need(
            self.num_heads % self.num_kv_heads == 0,
            f"sft.num_heads={self.num_heads} is not divisible by sft.num_kv_heads={self.num_kv_heads}",
        )
        _need(self.lr > 0, f"sft.lr={self.lr}: must be > 0")


@dataclass
class EvalConfig:
    n: int = 512  # held-out samples; at 256 the standard error is ~3 points
    temperature: float = 1.0  # accuracy of the sampling policy (pass@1), as trained
    max_new_tokens: int = 384
    batch: int = 64

    def __post_init__(self) -> None:
        _need(self.n > 0, f"eval.n={self.n}: must be positive")
        _need(self.temperature >= 0, f"eval.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        _need(self.batch > 0, f"eval.batch={self.batch}: must be positive")


@dataclass
class RolloutConfig:
    engines: int = 1  # rollout engine processes
    slots: int = 64  # concurrent sequences per engine
    lookahead: int = 16  # samples queued per engine beyond its slots
    threads: int = 1  # torch threads per engine process
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 384
    prefill_tokens: int = 512  # prompt tokens prefilled per engine step
    attention: str = "auto"  # decode attention: auto | kernel (C, CPU) | bmm | sdpa (see engine/runner.py)

    def __post_init__(self) -> None:
        _need(
            self.attention in ("auto", "kernel", "bmm", "sdpa"),
            f"rollout.attention={self.attention!r}: use auto, kernel, bmm or sdpa",
        )
        for k in ("engines", "slots", "threads", "max_new_tokens", "prefill_tokens"):
            _need(getattr(self, k) > 0, f"rollout.{k}={getattr(self, k)}: must be positive")
        _need(self.lookahead >= 0, f"rollout.lookahead={self.lookahead}: must be >= 0")
        _need(
            self.temperature > 0,
            f"rollout.temperature={self.temperature}: RL needs sampling; use a value > 0",
        )
        _need(0 < self.top_p <= 1, f"rollout.top_p={self.top_p}: must be in (0, 1]")


MODES = (
    "sync",
    "pipe",
    "async",
    "partial",
    "multiversion",
)  # = flow.policies.POLICIES (a test keeps them equal)


@dataclass
class FlowConfig:
    mode: str = "sync"  # sync (more modes plug in as policies)
    prompts_per_round: int = 16  # R
    samples_per_prompt: int = 8  # K
    train_batch: int = 128  # B samples per optimizer step; U = B / K groups
    steps: int = 120  # optimizer steps in the run
    time_limit_s: float | None = None  # stop issuing steps after this much training time (None = off)
    max_staleness: int = 1  # K for the off-policy modes (sync is always 0)
    frontier: int | None = None  # pipe: admit only the F_w lowest unfinished groups (None = U)
    rollout_groups: int | None = None  # partial/multiversion: groups per version (None = max(R, 2U))
    checkpoint_every: int = 1  # publishing steps between checkpoints (and always the last step)
    keep_checkpoints: int = 2  # older checkpoints are deleted

    def __post_init__(self) -> None:
        _need(self.mode in MODES, f"flow.mode={self.mode!r}: use one of {', '.join(MODES)}")
        for k in ("prompts_per_round", "samples_per_prompt", "train_batch", "steps"):
            _need(getattr(self, k) > 0, f"flow.{k}={getattr(self, k)}: must be positive")
        _need(
            self.train_batch % self.samples_per_prompt == 0,
            f"flow.train_batch={self.train_batch} is not a multiple of flow.samples_per_prompt="
            f"{self.samples_per_prompt}; a step trains whole groups",
        )
        U = self.train_batch // self.samples_per_prompt
        _need(
            self.prompts_per_round % U == 0,
            f"flow.prompts_per_round={self.prompts_per_round} is not a multiple of train_batch/samples_per_prompt"
            f"={U}; a round must split into whole steps",
        )
        _need(self.max_staleness >= 0, f"flow.max_staleness={self.max_staleness}: must be >= 0")
        _need(
            self.mode in ("sync", "pipe") or self.max_staleness >= 1,
            f"flow.max_staleness=0 with flow.mode={self.mode}: off-policy modes need >= 1 (or use sync/pipe)",
        )
        _need(
            self.frontier is None or self.frontier > 0,
            f"flow.frontier={self.frontier}: must be positive or null",
        )
        _need(
            self.rollout_groups is None or self.rollout_groups >= self.groups_per_step,
            f"flow.rollout_groups={self.rollout_groups}: must be >= train_batch/samples_per_prompt "
            f"({self.groups_per_step}) so a version can fill a train step",
        )
        _need(
            self.time_limit_s is None or self.time_limit_s > 0,
            f"flow.time_limit_s={self.time_limit_s}: must be positive seconds, or null for no limit",
        )
        _need(self.checkpoint_every > 0, f"flow.checkpoint_every={self.checkpoint_every}: must be positive")
        _need(self.keep_checkpoints > 0, f"flow.keep_checkpoints={self.keep_checkpoints}: must be positive")

    @property
    def groups_per_step(self) -> int:
        return self.train_batch // self.samples_per_prompt


@dataclass
class RunConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    train: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0
    out: str = "runs"
    tensorboard: bool = False  # also write scalars to RUN_DIR/tensorboard (pip install tailrace[tensorboard])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- mechanical mapping of dicts / overrides onto dataclasses ---------------------------------


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert `value` to the annotated type `tp`; strings from the CLI are parsed as YAML."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list, e.g. [1, 2]")
        (inner, *_) = typing.get_args(tp) or (Any,)
        return origin(_coerce(v, inner, key) for v in value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r}: expected a string")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.')}: {e}") from None


def _set_path(tree: dict[str, Any], dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{dotted}: {p} is not a section")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    node[parts[-1]] = value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """["--train.lr=1e-4", "--flow.mode", "pipe"] -> nested dict."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or len(a) == 2:
            raise ConfigError(f"unexpected argument {a!r}; overrides look like --section.key=value")
        body = a[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, raw = body, args[i + 1]
            i += 1
        else:
            raise ConfigError(f"--{body} has no value; write --{body}=VALUE")
        _set_path(tree, key, raw)
        i += 1
    return tree


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, cls: type = RunConfig
) -> Any:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found; pass an existing YAML file to --config")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(
                f"config file {p} is not valid YAML ({str(e).splitlines()[0]}); fix its syntax"
            ) from None
    data = _merge(data, parse_overrides(overrides or []))
    return _build(cls, data, "")


def dump_config(cfg: Any) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
