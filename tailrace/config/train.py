"""The trainer's sections: the optimizer and batch shape (`TrainerConfig`) and its loss (`LossConfig`).

The loss, correction and advantage names are plain strings here: the registries in trainer/losses.py
and trainer/advantages.py own the names and each loss's defaults (clip range, paired estimator), and
the CLI checks a name against its registry right after loading (cli/choices.py). None below means
"the chosen variant's own default", resolved by the trainer when it picks the variant.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tailrace.common import ConfigError, one_line
from tailrace.config.fields import need, section, setting

DECAYS = ("constant", "linear", "cosine")  # train.lr_schedule: the learning rate after its warmup


@dataclass
class LossConfig:
    name: str = setting(
        "grpo",
        "the policy-gradient variant: how per-token terms aggregate, its clip range, the ratio's level",
    )
    eps_low: float | None = setting(None, "clip the ratio below at 1 - eps_low (null = the variant's own)")
    eps_high: float | None = setting(None, "clip the ratio above at 1 + eps_high (null = the variant's own)")
    max_new_tokens: int | None = setting(
        None, "drgrpo's constant normaliser: set it to rollout.max_new_tokens"
    )
    kl_coef: float = setting(0.0, "weight of the KL penalty to the reference policy (0 = none)")
    kl_type: str = setting(
        "k3",
        "the KL penalty's estimator: k3 = exp(ref - logp) - (ref - logp) - 1 (GRPO's, verl's low_var_kl), "
        "k2 = (logp - ref)^2 / 2 (verl's mse: on the policy's samples its gradient is the reverse KL's), "
        "k1 = logp - ref (verl's kl)",
    )
    ref_sync_steps: int = setting(
        0,
        "every this many steps the KL penalty's reference moves to the policy: ref = alpha x policy + "
        "(1 - alpha) x ref, alpha train.loss.ref_sync_alpha (TRL's sync_ref_model with ref_model_sync_steps; "
        "alpha 1: ProRL's reference reset); 0 = the reference stays the policy the run started from",
    )
    ref_sync_alpha: float = setting(
        1.0,
        "train.loss.ref_sync_steps' mixup weight of the policy (TRL's ref_model_mixup_alpha, its default 0.6); "
        "1 = the reference becomes the policy (the only one a LoRA run takes: two adapters mixed are no "
        "adapter of their rank)",
    )
    entropy_coef: float = setting(
        0.0,
        "weight of an entropy bonus: the entropy of the policy at each trained token, aggregated as the loss, "
        "taken off it (verl's entropy_coeff; 0 = none); it keeps a batch without reward signal training",
    )
    clip_c: float | None = setting(
        None,
        "dual clip (verl's clip_ratio_c, its default 3): a token whose advantage is negative loses at most "
        "clip_c times its size, so one the policy made far likelier than the sampler did (ratio > clip_c, "
        "off policy) is pushed down no further (null = no cap; PPO's min objective only: not cispo)",
    )
    tis_cap: float = setting(2.0, "C: the importance-weight cap of the tis and decoupled corrections")
    ratio_low: float = setting(0.5, "icepop keeps tokens (geo_mask sequences) whose pi_prox/pi_behav >= this")
    ratio_high: float = setting(
        2.0, "icepop keeps tokens (geo_mask sequences) whose pi_prox/pi_behav <= this"
    )
    top_entropy: float = setting(
        1.0,
        "train on the step's live tokens whose entropy under the step's weights is in this top share, the "
        'others out of the loss, its normaliser unchanged ("Beyond the 80/20 Rule": 0.2; TRL\'s '
        "top_entropy_quantile); 1 = every token. Below 1 a step takes one more forward first",
    )
    correction: str | None = setting(
        None,
        "off-policy correction: where the ratio's anchor and weight come from (null = the mode's own: "
        "none for sync and pipe, tis for async and partial, behaviour for multiversion)",
    )

    def __post_init__(self) -> None:
        need(
            self.eps_low is None or 0.0 < self.eps_low <= 1.0,
            f"train.loss.eps_low={self.eps_low}: must lie in (0, 1], e.g. 0.2 (1: no lower bound)",
        )
        need(
            self.eps_high is None or self.eps_high > 0.0,
            f"train.loss.eps_high={self.eps_high}: must be > 0, e.g. 0.2 (0.28 for clip-higher)",
        )
        need(
            self.name != "drgrpo" or bool(self.max_new_tokens and self.max_new_tokens > 0),
            "train.loss.max_new_tokens is required for drgrpo; set it to the rollout's max_new_tokens",
        )
        need(
            self.max_new_tokens is None or self.max_new_tokens > 0,
            f"train.loss.max_new_tokens={self.max_new_tokens}: must be positive",
        )
        need(self.kl_coef >= 0, f"train.loss.kl_coef={self.kl_coef}: must be >= 0 (0 = no KL penalty)")
        need(
            self.ref_sync_steps >= 0,
            f"train.loss.ref_sync_steps={self.ref_sync_steps}: must be >= 0 (0 = a fixed reference), e.g. 100",
        )
        need(
            not self.ref_sync_steps or self.kl_coef > 0,
            f"train.loss.ref_sync_steps={self.ref_sync_steps} with train.loss.kl_coef=0: the reference is the "
            "KL penalty's alone; set train.loss.kl_coef (e.g. 0.01) or drop train.loss.ref_sync_steps",
        )
        need(
            0.0 < self.ref_sync_alpha <= 1.0,
            f"train.loss.ref_sync_alpha={self.ref_sync_alpha}: must lie in (0, 1], e.g. 0.6 (1: a reset)",
        )
        need(
            self.entropy_coef >= 0,
            f"train.loss.entropy_coef={self.entropy_coef}: must be >= 0 (0 = no entropy bonus), e.g. 0.001",
        )
        need(
            0.0 < self.top_entropy <= 1.0,
            f"train.loss.top_entropy={self.top_entropy}: must lie in (0, 1], e.g. 0.2 (1: every token)",
        )
        need(
            self.clip_c is None or self.clip_c > 1.0,
            f"train.loss.clip_c={self.clip_c}: must be > 1 (the cap on a negative advantage's ratio), e.g. 3",
        )
        need(
            self.clip_c is None or self.name != "cispo",
            f"train.loss.clip_c={self.clip_c} does not apply to cispo, whose capped weight keeps every "
            "token's gradient already; set it to null or use another train.loss.name",
        )
        need(self.tis_cap >= 1.0, f"train.loss.tis_cap={self.tis_cap}: must be >= 1 (2 is typical)")
        need(
            0.0 < self.ratio_low <= 1.0 <= self.ratio_high,
            f"train.loss.ratio_low={self.ratio_low}, ratio_high={self.ratio_high}: need 0 < low <= 1 <= high "
            "(e.g. 0.5 and 2)",
        )


# The projections a LoRA adapter may adapt, as PEFT names them for Llama/Qwen2 (the decoder's module names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the modules a fused family's checkpoint (Phi-3's) and its PEFT adapters name, and the targets each stacks
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_module(target: str) -> str:
    """The fused module (Phi-3's) that stacks projection `target`, or `target` itself where none does."""
    return next((name for name, parts in FUSED_TARGETS.items() if target in parts), target)


@dataclass
class LoraConfig:
    rank: int = setting(0, "LoRA rank r: train low-rank adapters on a frozen base (0 = train every weight)")
    alpha: float = setting(
        16.0, "LoRA alpha: an adapter's update is scaled by alpha / rank (PEFT's lora_alpha)"
    )
    targets: tuple[str, ...] = setting(
        LORA_TARGETS,
        "the projections that get an adapter, by PEFT's names (q_proj ... down_proj); on a mixture-of-experts "
        "model (Qwen3-MoE) the attention's only, its MLPs frozen",
    )
    init: str | None = setting(
        None,
        "a PEFT LoRA adapter directory to start from (e.g. an SFT adapter), instead of a fresh adapter; "
        "its r, lora_alpha and target_modules must be train.lora's rank, alpha and targets",
    )

    def __post_init__(self) -> None:
        need(self.rank >= 0, f"train.lora.rank={self.rank}: must be >= 0 (0 = no adapter), e.g. 8")
        need(self.alpha > 0, f"train.lora.alpha={self.alpha}: must be > 0, e.g. 16")
        self.targets = tuple(self.targets)
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        need(
            not bad and len(set(self.targets)) == len(self.targets) and bool(self.targets),
            f"train.lora.targets={list(self.targets)}: name each of some of {', '.join(LORA_TARGETS)} once",
        )
        need(
            self.init is None or self.rank > 0,
            f"train.lora.init={self.init}: set train.lora.rank to the adapter's r as well",
        )

    def check_init(self) -> None:
        """The adapter at `init` is one this config would train: its file says so (cheap). Asked when a
        run starts, not at every load of its config: a resume, a report or an evaluation of the run
        needs the adapter no more."""
        if self.init is None:
            return
        f = Path(self.init) / "adapter_config.json"
        try:
            peft = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"train.lora.init={self.init}: {f} is not a readable PEFT adapter config ({one_line(e)}); "
                "point it at a directory that peft's save_pretrained wrote"
            ) from None
        theirs = (peft.get("r"), float(peft.get("lora_alpha", 0)), sorted(peft.get("target_modules") or ()))
        ours = (self.rank, self.alpha, sorted(self.targets))
        if set(theirs[2]) & set(FUSED_TARGETS):  # a Phi-3 adapter: its fused modules, each some of ours
            ours = (*ours[:2], sorted({fused_module(t) for t in self.targets}))
        need(
            theirs == ours,
            f"train.lora.init={self.init}: the adapter has r={theirs[0]}, lora_alpha={theirs[1]:g}, "
            f"target_modules={theirs[2]}, the config rank={ours[0]}, alpha={ours[1]:g}, targets={ours[2]}; "
            f"set --train.lora.rank={theirs[0]} --train.lora.alpha={theirs[1]:g} "
            f"--train.lora.targets=[{', '.join(t for m in theirs[2] for t in FUSED_TARGETS.get(m, (m,)))}]",
        )


LORA_LR_FACTOR = 10.0


@dataclass
class CriticConfig:
    lr: float | None = setting(
        None,
        "the critic's learning rate (null = 10x the policy's train.lr, verl's ratio: 1e-5 against 1e-6)",
    )
    gamma: float = setting(1.0, "GAE's discount over the response's tokens (verl's algorithm.gamma)")
    lam: float = setting(
        1.0, "GAE's lambda (verl's algorithm.lam); 1 with gamma 1: the reward less each value"
    )
    value_clip: float | None = setting(
        0.5,
        "clip a value's move from its pre-step estimate to this in the value loss (verl's cliprange_value; "
        "null = the plain squared error)",
    )
    warmup_steps: int = setting(
        0,
        "steps at the run's start that train the critic alone, the policy's weights held (verl's "
        "trainer.critic_warmup): its values learn the returns before they steer the policy; the policy's "
        "learning-rate schedule starts after them (0 = off)",
    )

    def __post_init__(self) -> None:
        need(self.lr is None or self.lr > 0, f"train.critic.lr={self.lr}: must be > 0, e.g. 1e-5, or null")
        need(
            self.warmup_steps >= 0,
            f"train.critic.warmup_steps={self.warmup_steps}: must be >= 0 (0 = off), e.g. 10",
        )
        need(0 < self.gamma <= 1, f"train.critic.gamma={self.gamma}: must lie in (0, 1], e.g. 1")
        need(0 <= self.lam <= 1, f"train.critic.lam={self.lam}: must lie in [0, 1], e.g. 1 (or 0.95)")
        need(
            self.value_clip is None or self.value_clip > 0,
            f"train.critic.value_clip={self.value_clip}: must be > 0, e.g. 0.5, or null (no clip)",
        )


def auto_lr(num_params: int, lora: bool = False) -> float:
    """The default learning rate for a policy of `num_params` parameters: 2e-4 up to 2M (what moved the
    built-in sub-2M policy in DESIGN §6: +18 points in 9 min), then falling as N^-0.65, which meets
    the 1e-6 that verl and TRL use for 7B policies (135M: 1.3e-5; the SmolLM2 recipe in the README
    measured 2e-5). A LoRA adapter on a base of `num_params` gets `LORA_LR_FACTOR` times that: the
    factor Thinking Machines' "LoRA Without Regret" (2025) measured between the best LoRA and full
    fine-tuning learning rates, RL included; the built-in model's tenants trained at 2e-3 (bench/README.md)."""
    return 2e-4 * min(1.0, (2e6 / num_params) ** 0.65) * (LORA_LR_FACTOR if lora else 1.0)


@dataclass
class TrainerConfig:
    lr: float | None = setting(
        None,
        "AdamW learning rate (null = by the policy's size: 2e-4 up to 2M parameters, then "
        "2e-4 * (2M / N)^0.65: ~1.3e-5 at 135M, ~1e-6 at 7B; 10x that with train.lora; see auto_lr)",
    )
    lr_warmup_steps: int = setting(
        0, "optimizer steps of linear warmup to train.lr (lr/N, 2lr/N, ..., lr; 0 = none); at most flow.steps"
    )
    lr_schedule: str = setting(
        "constant",
        "after the warmup: constant, linear or cosine (decaying to train.lr x train.lr_min_ratio at the "
        "policy's last step, flow.steps)",
    )
    lr_min_ratio: float = setting(0.0, "where a linear or cosine decay ends, as a share of train.lr")
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas")
    eps: float = setting(1e-8, "AdamW epsilon")
    weight_decay: float = setting(
        0.0, "AdamW weight decay; it pulls the policy from its warm start regardless of reward"
    )
    grad_clip: float | None = setting(1.0, "max global gradient norm (null = measure only)")
    mini_batches: int = setting(
        1,
        "optimizer updates a step takes over its groups: split in order into this many mini-batches, each "
        "its own update and loss normaliser (verl's train_batch_size / ppo_mini_batch_size, TRL's "
        "steps_per_generation); above 1, one extra forward first gives every update the step's pre-update "
        "policy to take its ratio against, as PPO does; at most flow.train_batch / flow.samples_per_prompt",
    )
    epochs: int = setting(
        1,
        "passes over a step's mini-batches, each an optimizer update (verl's ppo_epochs, TRL's "
        "num_iterations); the ratio after the first is clipped against the step's pre-update policy",
    )
    micro_batch_tokens: int | None = setting(
        None, "rows x padded length per forward (null = as many as train.memory_gb pays for)"
    )
    memory_gb: float | None = setting(
        None,
        "the trainer's activation budget in GiB: it sets the tokens per forward (null = 30% of the "
        "memory available at start, after the optimizer state; see trainer/memory.py)",
    )
    gradient_checkpointing: bool | None = setting(
        None,
        "keep each layer's input alone and run the layer again in the backward (verl's "
        "enable_gradient_checkpointing, TRL's gradient_checkpointing): a token's activations cost about one "
        "layer's, not all of them, for one more forward of the layers; null = on where the activation "
        "budget (train.memory_gb) would not hold one of the run's longest rows (prompt + "
        "rollout.max_new_tokens) without it",
    )
    bf16: bool = setting(False, "autocast the forward to bfloat16 (CPU and CUDA); weights keep their dtype")
    temperature: float = setting(1.0, "temperature of the trained logprobs: must equal rollout.temperature")
    routing_replay: bool = setting(
        False,
        "a mixture of experts: the trainer's forward takes the experts the rollout engine chose for each "
        "token (R3; their weights from the trainer's router), so engine and trainer compute the same "
        "mixture: bf16 rounding no longer flips an expert (tailrace's own engine only)",
    )
    moe_aux_loss: float = setting(
        0.0,
        "a mixture of experts: the load-balancing loss's coefficient (transformers' router_aux_loss_coef, "
        "which transformers and TRL add when the model's config sets output_router_logits), over each "
        "forward's real tokens; 0: off (RL fine-tuning usually trains without it)",
    )
    loss: LossConfig = section(LossConfig, "the clipped policy-gradient loss")
    lora: LoraConfig = section(LoraConfig, "low-rank adapters on a frozen base (rank 0: off)")
    advantage: str | None = setting(
        None,
        "advantage estimator (null = the one the loss was published with); gae: PPO's, per token from a "
        "critic trained beside the policy (train.critic)",
    )
    critic: CriticConfig = section(CriticConfig, "PPO's value model, with train.advantage=gae")
    max_staleness: int | None = setting(
        None, "mask tokens more than this many versions behind the trainer (null = off)"
    )
    pad_id: int = setting(0, "token id padding micro-batch rows (masked out of the loss)")
    mask_truncated: bool = setting(
        False,
        "DAPO's overlong filtering: a response cut at rollout.max_new_tokens gets no gradient (its reward "
        "still counts in its group's advantages)",
    )
    external: bool = setting(
        False,
        "train with a trainer of your own: it joins the run and pulls each step's batch "
        '(tailrace.client.TrainerClient; README: "Your own trainer"); the settings above then are yours to use',
    )
    world_size: int = setting(
        1,
        "data-parallel trainer processes (gloo on CPU, NCCL on GPU): each takes a token-balanced share of "
        "a step's rows and the gradients are all-reduced; rank 0 publishes and saves",
    )

    def moe_only(self) -> list[str]:
        """The settings set here that only a mixture of experts has a use for (the run refuses them on a
        dense policy when it starts)."""
        return [name for name in ("routing_replay", "moe_aux_loss") if getattr(self, name)]

    def __post_init__(self) -> None:
        need(
            self.lr is None or self.lr > 0,
            f"train.lr={self.lr}: must be > 0, e.g. 2e-5, or null (by model size)",
        )
        need(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            f"train.betas={self.betas}: give two numbers in [0, 1), e.g. [0.9, 0.999]",
        )
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        need(self.eps > 0, f"train.eps={self.eps}: must be > 0, e.g. 1e-8")
        need(
            self.lr_warmup_steps >= 0,
            f"train.lr_warmup_steps={self.lr_warmup_steps}: must be >= 0 (0: no warmup), e.g. 10",
        )
        need(
            self.lr_schedule in DECAYS,
            f"train.lr_schedule={self.lr_schedule!r}: use one of {', '.join(DECAYS)}",
        )
        need(
            0.0 <= self.lr_min_ratio <= 1.0,
            f"train.lr_min_ratio={self.lr_min_ratio}: must lie in [0, 1], e.g. 0.1",
        )
        need(
            not (self.lr_min_ratio and self.lr_schedule == "constant"),
            f"train.lr_min_ratio={self.lr_min_ratio} with train.lr_schedule=constant: nothing decays; set "
            "train.lr_schedule to linear or cosine, or drop train.lr_min_ratio",
        )
        need(
            self.mini_batches >= 1,
            f"train.mini_batches={self.mini_batches}: must be >= 1 (1: one optimizer update a step), e.g. 4",
        )
        need(self.epochs >= 1, f"train.epochs={self.epochs}: must be >= 1 (1: one pass over a step's groups)")
        need(self.weight_decay >= 0, f"train.weight_decay={self.weight_decay}: must be >= 0")
        need(
            self.moe_aux_loss >= 0,
            f"train.moe_aux_loss={self.moe_aux_loss}: must be >= 0 (0: off), e.g. 0.001",
        )
        need(
            self.grad_clip is None or self.grad_clip > 0,
            f"train.grad_clip={self.grad_clip}: must be > 0, or null to turn clipping off",
        )
        need(
            self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
            f"train.micro_batch_tokens={self.micro_batch_tokens}: must be positive, e.g. 4096, or null "
            "(sized by train.memory_gb)",
        )
        need(
            self.memory_gb is None or (math.isfinite(self.memory_gb) and self.memory_gb > 0),
            f"train.memory_gb={self.memory_gb}: must be positive GiB, e.g. 4, or null (30% of the memory "
            "available)",
        )
        need(
            self.temperature > 0,
            f"train.temperature={self.temperature}: must be > 0 (the sampling temperature)",
        )
        need(
            self.max_staleness is None or self.max_staleness >= 0,
            f"train.max_staleness={self.max_staleness}: must be >= 0, or null to turn it off",
        )
        need(self.pad_id >= 0, f"train.pad_id={self.pad_id}: must be a token id (>= 0)")
        need(
            self.world_size >= 1, f"train.world_size={self.world_size}: must be at least 1 (1 = one process)"
        )
        need(
            not (self.lora.rank and self.loss.ref_sync_steps and self.loss.ref_sync_alpha < 1),
            f"train.loss.ref_sync_alpha={self.loss.ref_sync_alpha} with train.lora: a LoRA run's reference "
            "is an adapter, and a mix of two adapters is none of their rank; set train.loss.ref_sync_alpha=1 "
            "(the reference becomes the policy) or train a full model",
        )
        default = vars(CriticConfig())
        changed = [f"train.critic.{k}" for k, v in vars(self.critic).items() if v != default[k]]
        need(
            self.advantage == "gae" or not changed,
            f"{', '.join(changed)} set with train.advantage={self.advantage or 'null'}: the critic trains only with "
            "train.advantage=gae; set that, or drop the critic's settings",
        )
        need(
            not (self.advantage == "gae" and self.external),
            "train.advantage=gae with train.external: the critic lives in tailrace's own trainer; your "
            "trainer takes rewards and computes its own advantages (drop train.advantage)",
        )
