"""The trainer's sections: the optimizer and batch shape (`TrainerConfig`) and its loss (`LossConfig`).

The name tables mirror the registries in trainer/losses.py and trainer/advantages.py (a test keeps them
equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailrace.errors import ConfigError

# loss name -> (default eps_low, default eps_high, paired advantage estimator)
LOSS_DEFAULTS = {"grpo": (0.2, 0.2, "grpo"), "dapo": (0.2, 0.28, "grpo"), "drgrpo": (0.2, 0.2, "drgrpo")}
CORRECTION_NAMES = ("none", "tis", "decoupled", "behaviour")
ADVANTAGE_NAMES = ("grpo", "drgrpo", "rloo")


@dataclass
class LossConfig:
    name: str = "grpo"  # grpo | dapo | drgrpo
    eps_low: float | None = None  # None = the variant's default (0.2)
    eps_high: float | None = None  # None = the variant's default (0.2; dapo 0.28)
    max_new_tokens: int | None = None  # drgrpo's constant normaliser; set to the rollout's max_new_tokens
    kl_coef: float = 0.0  # k3 penalty to the reference policy; > 0 needs a ref_model
    tis_cap: float = 2.0  # C for the tis and decoupled corrections
    correction: str = "none"  # none | tis | decoupled | behaviour

    def __post_init__(self) -> None:
        if self.name not in LOSS_DEFAULTS:
            raise ConfigError(f"loss.name={self.name!r}: choose one of {', '.join(LOSS_DEFAULTS)}")
        if self.correction not in CORRECTION_NAMES:
            raise ConfigError(
                f"loss.correction={self.correction!r}: choose one of {', '.join(CORRECTION_NAMES)}"
            )
        eps_low, eps_high, _ = LOSS_DEFAULTS[self.name]
        self.eps_low = eps_low if self.eps_low is None else self.eps_low
        self.eps_high = eps_high if self.eps_high is None else self.eps_high
        if not 0.0 < self.eps_low < 1.0:
            raise ConfigError(f"loss.eps_low={self.eps_low}: must lie in (0, 1), e.g. 0.2")
        if not self.eps_high > 0.0:
            raise ConfigError(f"loss.eps_high={self.eps_high}: must be > 0, e.g. 0.2 (0.28 for clip-higher)")
        if self.name == "drgrpo" and not (self.max_new_tokens and self.max_new_tokens > 0):
            raise ConfigError(
                "loss.max_new_tokens is required for drgrpo; set it to the rollout's max_new_tokens"
            )
        if self.max_new_tokens is not None and self.max_new_tokens <= 0:
            raise ConfigError(f"loss.max_new_tokens={self.max_new_tokens}: must be positive")
        if self.kl_coef < 0:
            raise ConfigError(f"loss.kl_coef={self.kl_coef}: must be >= 0 (0 = no KL penalty)")
        if self.tis_cap < 1.0:
            raise ConfigError(f"loss.tis_cap={self.tis_cap}: must be >= 1 (2 is typical)")


@dataclass
class TrainerConfig:
    # 2e-4 is what moved the default sub-1M..2M-parameter policy in DESIGN §6 (+18 points in 9 min);
    # billion-parameter policies want ~1e-6.
    lr: float = 2e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # decay would pull the policy away from its warm start regardless of reward
    grad_clip: float | None = 1.0  # max global grad norm; None = measure only
    micro_batch_tokens: int = 8192  # rows x padded length per forward; bounds activation memory
    bf16: bool = False  # autocast the forward to bfloat16 (CPU and CUDA); weights stay in their dtype
    temperature: float = 1.0  # must equal the rollout's sampling temperature
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: str | None = None  # grpo | drgrpo | rloo; None = the loss's own (drgrpo -> drgrpo, else grpo)
    max_staleness: int | None = None  # K: mask tokens more than K versions behind the trainer; None = off
    pad_id: int = 0

    def __post_init__(self) -> None:
        if self.advantage is None:
            self.advantage = LOSS_DEFAULTS[self.loss.name][2]
        if self.advantage not in ADVANTAGE_NAMES:
            raise ConfigError(
                f"trainer.advantage={self.advantage!r}: choose one of {', '.join(ADVANTAGE_NAMES)}"
            )
        if not self.lr > 0:
            raise ConfigError(f"trainer.lr={self.lr}: must be > 0, e.g. 2e-4")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"trainer.betas={self.betas}: give two numbers in [0, 1), e.g. [0.9, 0.999]")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not self.eps > 0:
            raise ConfigError(f"trainer.eps={self.eps}: must be > 0, e.g. 1e-8")
        if self.weight_decay < 0:
            raise ConfigError(f"trainer.weight_decay={self.weight_decay}: must be >= 0")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(
                f"trainer.grad_clip={self.grad_clip}: must be > 0, or null to turn clipping off"
            )
        if self.micro_batch_tokens < 1:
            raise ConfigError(
                f"trainer.micro_batch_tokens={self.micro_batch_tokens}: must be positive, e.g. 8192"
            )
        if not self.temperature > 0:
            raise ConfigError(
                f"trainer.temperature={self.temperature}: must be > 0 (the sampling temperature)"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(
                f"trainer.max_staleness={self.max_staleness}: must be >= 0, or null to turn it off"
            )
