"""The model sections: which policy to train, and the shape and warm-start recipe of the built-in one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tailrace.config.fields import need, setting


@dataclass
class ModelSpec:
    path: str | None = setting(
        None, "a local Hugging Face checkpoint dir; null = the built-in model (arch), warm-started (sft)"
    )
    dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto",
        "the rollout engines' (and eval's) weight dtype: auto = bfloat16 on a GPU with native bf16 (Ampere "
        "on: half the memory a weight version takes), float32 elsewhere (a CPU, where float32 is the exact "
        "and usually the faster path)",
    )


@dataclass
class ArchConfig:
    """The built-in default model's shape (a Llama-style decoder over the character tokenizer).

    Used when model.path is unset; with `SFTConfig` it makes the warm-start recipe. Small on purpose
    (0.8M parameters): on two CPU cores it crosses chainsum's learning transition (finding each term
    by its letter) in ~1,500 small steps and is past it by ~2,700 (30,000 demonstrations, under 5
    minutes), a point a 2.4M hidden-256 model reaches far later here (3.9% after 900 steps vs 23%).
    """

    hidden_size: int = setting(128, "model width")
    num_layers: int = setting(4, "decoder layers")
    num_heads: int = setting(4, "attention heads (must divide hidden_size)")
    num_kv_heads: int = setting(2, "key/value heads, shared by groups of query heads (must divide num_heads)")
    intermediate_size: int = setting(384, "width of each layer's gated MLP")
    max_len: int = setting(512, "longest sequence the model takes, prompt + response, in tokens")

    def __post_init__(self) -> None:
        for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_len"):
            need(getattr(self, k) > 0, f"arch.{k}={getattr(self, k)}: must be positive")
        need(
            self.hidden_size % self.num_heads == 0,
            f"arch.hidden_size={self.hidden_size} is not divisible by arch.num_heads={self.num_heads}",
        )
        need(
            self.num_heads % self.num_kv_heads == 0,
            f"arch.num_heads={self.num_heads} is not divisible by arch.num_kv_heads={self.num_kv_heads}",
        )


@dataclass
class SFTConfig:
    """How the built-in default model is warm-started: supervised training on chainsum demonstrations.

    With `ArchConfig` this is the warm-start recipe; its hash names the cache entry, so a changed
    recipe rebuilds. One demonstration step in five carries a slip (a sum off by one, carried on):
    the warm-started policy then makes the mistakes a real base model makes, lands at ~40% accuracy,
    and GRPO has errors to remove that compound over long chains. Without slips it lands higher with
    less to gain (53% at 15% slips).
    """

    examples: int = setting(30000, "chainsum demonstrations to train on")
    slip: float = setting(
        0.2, "chance that a demonstration step's sum is off by one (carried on to the answer)"
    )
    batch_tokens: int = setting(
        1024, "tokens per optimizer step (length-bucketed): many small steps learn fastest"
    )
    epochs: int = setting(1, "passes over the demonstrations")
    lr: float = setting(2e-3, "peak learning rate: linear warmup, then cosine decay to a tenth")
    warmup: int = setting(100, "optimizer steps of learning-rate warmup")
    seed: int = setting(0, "seed of the demonstrations and the initial weights")
    threads: int = setting(2, "torch threads while warm-starting")
    bf16: bool = setting(True, "autocast the forward to bfloat16 (weights stay fp32)")

    def __post_init__(self) -> None:
        for k in ("examples", "batch_tokens", "epochs", "threads"):
            need(getattr(self, k) > 0, f"sft.{k}={getattr(self, k)}: must be positive")
        need(0.0 <= self.slip < 1.0, f"sft.slip={self.slip}: must be in [0, 1)")
        need(self.lr > 0, f"sft.lr={self.lr}: must be > 0")
        need(self.warmup >= 0, f"sft.warmup={self.warmup}: must be >= 0")
