"""PPO's critic (`train.advantage=gae`): a value model beside the policy, its values before a step's
updates, GAE's per-token advantages from them, and its own update beside each of the policy's.

The value model is the policy's decoder, its weights copied when the trainer starts (verl's critic
starts from the actor's checkpoint), with a scalar head where the LM head was: transformers'
`*ForTokenClassification` with one label. The head starts at zero, so every value is 0 at first and the
first step's advantages are the whitened rewards. It trains whole, on its own AdamW
(`train.critic.lr`, null: 10x the policy's, verl's ratio), with the policy's betas, weight decay,
gradient clip and micro-batch size, on the same mini-batches and epochs. On a LoRA run (`train.lora`)
it is an adapter of its own (the run's rank, alpha and targets) on the policy's frozen base, whose
tensors it shares (no copy), and its head: what trains, and what a checkpoint holds, is those.

A step: one no-grad pass of the critic over the step's rows (its values, kept for the clipped value
loss), GAE per row (`gae.gae`), the advantages whitened over every live token of the step (every
mini-batch, every data-parallel rank: their `moments` summed), then for each optimizer update of the
policy one of the critic on the same rows, its loss the token mean over the mini-batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Callable, Sequence

import torch
from torch import nn

from tailrace.common import ConfigError
from tailrace.config import TrainerConfig
from tailrace.config.train import LoraConfig
from tailrace.model.config import ModelConfig
from tailrace.model.decoder import DecoderModel, embed, run_layers
from tailrace.model.lora import LoRALinear
from tailrace.trainer.batch import TrainBatch
from tailrace.trainer.gae import explained_variance, gae, moments, value_loss, whitened
from tailrace.trainer.optim import all_reduce_grads, build_adamw

CRITIC_LR_RATIO = 10.0  # verl's examples: critic 1e-5 against the actor's 1e-6
Autocast = Callable[[], contextlib.AbstractContextManager]


class ValueModel(nn.Module):
    """The policy's decoder (a copy; with `lora`, its frozen base shared and an adapter of its own) and a
    scalar head: input_ids (B, T) -> values (B, T) in fp32."""

    def __init__(self, policy: nn.Module, lora: LoraConfig | None = None):
        super().__init__()
        cfg = getattr(policy, "config", None)
        if not isinstance(cfg, ModelConfig):
            raise ConfigError(
                "train.advantage=gae needs a tailrace decoder as the policy (its critic is a copy of it "
                "with a value head); use another train.advantage with this model"
            )
        self.config = cfg
        first = next(policy.parameters())
        if lora is not None and lora.rank:
            self.model = _on_the_base(policy.model, lora)
        else:
            self.model = DecoderModel(cfg)
            self.model.load_state_dict(policy.model.state_dict())
            self.model.to(device=first.device, dtype=first.dtype)
        self.rotary, self.local_rotary = policy.rotary, policy.local_rotary  # tables, no weights: shared
        dtype = torch.float32 if first.dtype in (torch.bfloat16, torch.float16) else first.dtype
        self.score = nn.Linear(cfg.hidden_size, 1, device=first.device, dtype=dtype)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)
        self.gradient_checkpointing = False  # as the policy's (train.gradient_checkpointing)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = embed(self.model.embed_tokens(input_ids), self.config)
        x = run_layers(
            self.model.layers, x, self.rotary, self.local_rotary, input_ids.shape[1],
            recompute=self.gradient_checkpointing and torch.is_grad_enabled(),
        )  # fmt: skip
        return self.score(self.model.norm(x)).squeeze(-1).float()


def _on_the_base(decoder: DecoderModel, lora: LoraConfig) -> DecoderModel:
    """`decoder` (a LoRA policy's) again, every frozen tensor the policy's own (shared, not copied), each
    adapted projection with a fresh adapter of its own (B at zero: it starts as the base)."""
    frozen = [t for t in (*decoder.parameters(), *decoder.buffers()) if not t.requires_grad]
    twin = copy.deepcopy(decoder, memo={id(t): t for t in frozen})
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, LoRALinear(child, lora.rank, lora.alpha))
    return twin


class Critic:
    def __init__(self, policy: nn.Module, cfg: TrainerConfig, policy_lr: float):
        self.cfg, self.grad_clip = cfg.critic, cfg.grad_clip
        # no dropout: its values must be the ones it is trained on
        self.model = ValueModel(policy, cfg.lora).eval()
        self.device = next(self.model.parameters()).device
        self.lr = cfg.critic.lr if cfg.critic.lr is not None else CRITIC_LR_RATIO * policy_lr
        self.opt = build_adamw(self.model, self.lr, cfg.betas, cfg.eps, cfg.weight_decay)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    @torch.no_grad()
    def values(self, shard: TrainBatch, tokens: int, autocast: Autocast) -> torch.Tensor:
        """The critic's value at every position of `shard`'s rows (0 on padding), `tokens` a forward."""
        out = torch.zeros_like(shard.behav_logp)
        for rows, mb in shard.indexed_micro_batches(tokens):
            with autocast():
                v = self.model(mb.to(self.device).input_ids)
            out[rows, : v.shape[1]] = v.to(out.device)
        return out

    def prepare(
        self, shards: Sequence[TrainBatch], live: Sequence[float], tokens: int, autocast: Autocast, world: int
    ) -> tuple[list[TrainBatch], dict[str, float]]:
        """`shards` (this rank's rows of each mini-batch, whose whole has `live` live tokens) with GAE's
        whitened advantages in `adv`, and the critic's values, returns and value-loss shares; and the
        step's figures: the values' mean and how much of the returns' variance they explain."""
        c = self.cfg
        got = []
        for s in shards:
            v = self.values(s, tokens, autocast)
            adv, ret = gae(s.seq_adv, v, s.versions >= 0, c.gamma, c.lam)
            got.append((s, v, adv, ret))
        # the step's sums: advantages (to whiten), returns and their errors (explained variance), values
        m = torch.stack(
            [
                torch.stack(
                    [moments(a, s.mask), moments(r, s.mask), moments(r - v, s.mask), moments(v, s.mask)]
                )
                for s, v, a, r in got
            ]
        ).sum(0)
        if world > 1:
            torch.distributed.all_reduce(m)
        out = [
            dataclasses.replace(
                s, adv=whitened(a, s.mask, m[0]), values=v, returns=r, vscale=s.mask / max(1.0, float(n))
            )
            for (s, v, a, r), n in zip(got, live)
        ]
        n_live = float(m[3][0])
        return out, {
            "values_mean": float(m[3][1]) / n_live if n_live else 0.0,
            "vf_explained_var": explained_variance(m[2], m[1]),
        }

    def backward(self, shard: TrainBatch, tokens: int, autocast: Autocast, world: int) -> dict[str, float]:
        """The value loss's gradient over this rank's rows of a mini-batch (all ranks' summed); returns
        the mini-batch's value_loss, its clipped tokens and live tokens (all ranks'). The caller clips,
        checks and steps (or not)."""
        self.opt.zero_grad(set_to_none=True)
        sums = torch.zeros(3, dtype=torch.float64)
        for mb in shard.micro_batches(tokens):
            mb = mb.to(self.device)
            with autocast():
                v = self.model(mb.input_ids)
            loss, st = value_loss(v, mb.values, mb.returns, mb.mask, mb.vscale, self.cfg.value_clip)
            n = mb.mask.sum()
            if bool(n > 0):
                loss.backward()
            sums += torch.stack([loss.detach(), st["vf_clip_frac"] * n, n]).double().cpu()
        if world > 1:
            all_reduce_grads(self.params)
            torch.distributed.all_reduce(sums)
        return {"value_loss": float(sums[0]), "vf_clipped": float(sums[1]), "vf_tokens": float(sums[2])}

    def clip_grad(self) -> float:
        """Clip the gradient to train.grad_clip; returns its norm before (the caller steps `opt`)."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip or float("inf")))

    def state_dict(self) -> dict:
        """What it trains (a LoRA critic's adapter and head, not the base it shares) and AdamW's state."""
        own = self._trained()
        return {
            "model": {k: v for k, v in self.model.state_dict().items() if k in own},
            "optimizer": self.opt.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        missing = self._trained() - set(state["model"])
        if missing:
            raise ValueError(f"the critic's state lacks {len(missing)} of its weights, e.g. {min(missing)}")
        self.model.load_state_dict(state["model"], strict=False)
        self.opt.load_state_dict(state["optimizer"])

    def _trained(self) -> set[str]:
        return {n for n, p in self.model.named_parameters() if p.requires_grad}
