"""The run's sections (task, rollout, flow, eval) and `RunConfig`, which composes every section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tailrace.config.check import need
from tailrace.config.model import ArchConfig, ModelSpec, SFTConfig
from tailrace.config.train import TrainerConfig


@dataclass
class TaskConfig:
    name: str = "chainsum"  # chainsum | gym:<reasoning_gym name> | jsonl:<path>
    reward_timeout_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        need(self.reward_timeout_s > 0, f"task.reward_timeout_s={self.reward_timeout_s}: must be > 0 seconds")


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
        need(
            self.attention in ("auto", "kernel", "bmm", "sdpa"),
            f"rollout.attention={self.attention!r}: use auto, kernel, bmm or sdpa",
        )
        for k in ("engines", "slots", "threads", "max_new_tokens", "prefill_tokens"):
            need(getattr(self, k) > 0, f"rollout.{k}={getattr(self, k)}: must be positive")
        need(self.lookahead >= 0, f"rollout.lookahead={self.lookahead}: must be >= 0")
        need(
            self.temperature > 0,
            f"rollout.temperature={self.temperature}: RL needs sampling; use a value > 0",
        )
        need(0 < self.top_p <= 1, f"rollout.top_p={self.top_p}: must be in (0, 1]")


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
        for k in ("prompts_per_round", "samples_per_prompt", "train_batch", "steps"):
            need(getattr(self, k) > 0, f"flow.{k}={getattr(self, k)}: must be positive")
        need(
            self.train_batch % self.samples_per_prompt == 0,
            f"flow.train_batch={self.train_batch} is not a multiple of flow.samples_per_prompt="
            f"{self.samples_per_prompt}; a step trains whole groups",
        )
        U = self.train_batch // self.samples_per_prompt
        need(
            self.prompts_per_round % U == 0,
            f"flow.prompts_per_round={self.prompts_per_round} is not a multiple of train_batch/samples_per_prompt"
            f"={U}; a round must split into whole steps",
        )
        need(self.max_staleness >= 0, f"flow.max_staleness={self.max_staleness}: must be >= 0")
        need(
            self.frontier is None or self.frontier > 0,
            f"flow.frontier={self.frontier}: must be positive or null",
        )
        need(
            self.rollout_groups is None or self.rollout_groups >= self.groups_per_step,
            f"flow.rollout_groups={self.rollout_groups}: must be >= train_batch/samples_per_prompt "
            f"({self.groups_per_step}) so a version can fill a train step",
        )
        need(
            self.time_limit_s is None or self.time_limit_s > 0,
            f"flow.time_limit_s={self.time_limit_s}: must be positive seconds, or null for no limit",
        )
        need(self.checkpoint_every > 0, f"flow.checkpoint_every={self.checkpoint_every}: must be positive")
        need(self.keep_checkpoints > 0, f"flow.keep_checkpoints={self.keep_checkpoints}: must be positive")

    @property
    def groups_per_step(self) -> int:
        return self.train_batch // self.samples_per_prompt


@dataclass
class EvalConfig:
    n: int = 512  # held-out samples; at 256 the standard error is ~3 points
    temperature: float = 1.0  # accuracy of the sampling policy (pass@1), as trained
    max_new_tokens: int = 384
    batch: int = 64

    def __post_init__(self) -> None:
        need(self.n > 0, f"eval.n={self.n}: must be positive")
        need(self.temperature >= 0, f"eval.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        need(self.batch > 0, f"eval.batch={self.batch}: must be positive")


@dataclass
class RunConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    arch: ArchConfig = field(default_factory=ArchConfig)
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
