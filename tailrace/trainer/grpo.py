"""GRPOTrainer: one train step per call over the groups it is given.

`step(groups, trainer_version)` flattens the groups into a TrainBatch, runs forward/backward per
micro-batch (gradient accumulation, exact thanks to the batch's global `scale`), clips the gradient
and steps AdamW — unless no group has a reward signal (all its rewards equal: every advantage zero)
and no KL or entropy term pulls on the weights; then the step is counted, reported `skipped` and changes
nothing. One update per step means the pre-update ("proximal") policy is the current one:
`prox = logp.detach()` from the same forward, with no second pass. With `train.mini_batches` k > 1 or
`train.epochs` e > 1 a step is k x e updates (PPO's): the groups split in order into k mini-batches, each
a TrainBatch of its own (its own loss normaliser), passed over e times; one no-grad forward first keeps
the step's pre-update logprobs (`TrainBatch.prox_logp`), the anchor of every update's ratio. A
mini-batch without reward signal takes no update. The model is only called as
`model(input_ids (B, T)) -> logits (B, T, V)`; it runs in eval mode (no dropout), because the policy
whose ratio we clip must be the one the engine sampled from. A loss or gradient norm that is not finite
raises `NonFiniteError` before the optimizer moves, so the weights never take a nan.

With `train.lora.rank` > 0 the model gets a LoRA adapter (`model.lora.attach`): the base is frozen and
AdamW holds the adapter's parameters alone; the step is otherwise the same. `adapter()` is its weights,
and `flat` (what a trainer process publishes) holds the adapter's parameters alone. With `train.bf16`
the frozen projections are kept in bf16 (`lora.store_frozen_projections`): the autocast GEMMs cast
them to bf16 on every forward anyway, so no value changes, and the base takes half the memory. With a
KL penalty and no `ref_model`, the reference is the model itself with its adapter off, or swapped for
the adapter the run started from (`lora.as_reference`, `lora.set_reference`): no second copy of the base.
With `train.advantage=gae` a critic (`trainer/critic.py`) gives every sampled token its advantage from
its values before the step, and takes an update of its own beside each of the policy's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Sequence

import torch
from torch import nn

from tailrace.config import ConfigError, TrainerConfig
from tailrace.config.train import auto_lr
from tailrace.model import lora
from tailrace.model.config import ModelConfig
from tailrace.model.device import available_bytes
from tailrace.model.flat import flatten_parameters
from tailrace.model.moe import balance_loss, balancing, replaying, take_load
from tailrace.trainer.advantages import ADVANTAGES
from tailrace.trainer.batch import TrainBatch, with_advantages
from tailrace.trainer.critic import Critic
from tailrace.trainer.logprobs import entropy_from_logits, token_logprobs
from tailrace.trainer.losses import CORRECTIONS, LOSSES, Bounds, aggregated, kl_penalty
from tailrace.trainer.memory import rank_share, size_micro_batch
from tailrace.trainer.optim import all_reduce_grads, build_adamw
from tailrace.trainer.packing import split_by_tokens
from tailrace.trainer.schedule import LRSchedule
from tailrace.types import Group

SUM_KEYS = ("loss", "pg_loss", "kl", "is_ratio", "clip_frac", "approx_kl", "ratio_mean", "tokens", "dropped",
            "entropy", "gap_sum", "gap_tokens", "moe_aux_loss", "entropy_bonus", "dual_clip_frac")  # fmt: skip
PEAK_KEYS = ("is_ratio_max", "ratio_max", "gap_max")


class NonFiniteError(RuntimeError):
    """A step's loss or gradient is inf or nan; raised before the optimizer moves."""


class _Sums:
    """Accumulates per-micro-batch tensors; one host sync at the end of the step."""

    def __init__(self) -> None:
        self.sum: dict[str, torch.Tensor] = {}
        self.max: dict[str, torch.Tensor] = {}

    def add(self, key: str, v: torch.Tensor) -> None:
        self.sum[key] = self.sum[key] + v if key in self.sum else v

    def peak(self, key: str, v: torch.Tensor) -> None:
        self.max[key] = torch.maximum(self.max[key], v) if key in self.max else v

    def merge(self, other: "_Sums") -> None:
        for k, v in other.sum.items():
            self.add(k, v)
        for k, v in other.max.items():
            self.peak(k, v)

    def get(self, key: str, default: float = 0.0) -> float:
        d = self.sum if key in self.sum else self.max
        return float(d[key]) if key in d else default


def _has_signal(g: Group) -> bool:
    """Some advantage of the group is non-zero: given ones, or rewards that differ (every estimator
    gives equal rewards zero advantage)."""
    return any(g.advantages) if g.advantages else len({t.reward for t in g.trajectories}) > 1


class GRPOTrainer:
    def __init__(
        self,
        model: nn.Module,
        cfg: TrainerConfig,
        ref_model: nn.Module | None = None,
        trainers: int = 1,
        total_steps: int = 0,
        longest: int = 0,
    ):
        """`trainers`: trainers sharing this device's memory (a run of several policies on one machine),
        each sizing its micro-batches from its share; `total_steps`: the policy's flow.steps, where a
        decaying learning rate (train.lr_schedule) ends; `longest`: the tokens of the run's longest row
        (prompt and response), which train.gradient_checkpointing=null sizes by."""
        if cfg.loss.kl_coef > 0 and ref_model is None and not cfg.lora.rank:
            raise ValueError(f"loss.kl_coef={cfg.loss.kl_coef} needs a ref_model; pass one or set kl_coef=0")
        self.cfg = cfg
        self.model = lora.attach(model, cfg.lora) if cfg.lora.rank else model
        self.base_saved = 0  # bytes: the frozen base's adapted projections (and experts) kept in bf16
        if cfg.lora.rank and cfg.bf16:  # their GEMMs run in bf16 anyway: store them so
            self.base_saved = lora.store_frozen_projections(model, torch.bfloat16)
        # None with a KL penalty: a LoRA trainer's own base is the reference, its adapter switched off
        self.ref_model = ref_model if cfg.loss.kl_coef > 0 else None
        # parameters now view one buffer: what the trainer publishes (with LoRA: the adapter alone)
        self.flat = flatten_parameters(model, trainable=bool(cfg.lora.rank))
        n = sum(p.numel() for p in model.parameters())  # the base's and, with LoRA, the adapter's
        self.lr = cfg.lr if cfg.lr is not None else auto_lr(n, bool(cfg.lora.rank))
        self.opt = build_adamw(model, self.lr, cfg.betas, cfg.eps, cfg.weight_decay)
        # PPO's value model (train.advantage=gae): a copy of the policy as it starts (on a LoRA run, an
        # adapter of its own on the same frozen base)
        self.critic = Critic(model, cfg, self.lr) if cfg.advantage == "gae" else None
        # the policy's schedule starts after the critic's warmup (train.critic.warmup_steps), as verl's
        # actor scheduler steps only when the actor does; the critic's runs from the run's start
        self.held = cfg.critic.warmup_steps if self.critic is not None else 0
        self.schedule = LRSchedule(
            self.lr, cfg.lr_warmup_steps, max(0, total_steps - self.held), cfg.lr_schedule, cfg.lr_min_ratio
        )
        self.critic_schedule = LRSchedule(
            self.lr, cfg.lr_warmup_steps, total_steps, cfg.lr_schedule, cfg.lr_min_ratio
        )
        self.loss_fn = LOSSES[cfg.loss.name]
        self.correct = CORRECTIONS[cfg.loss.correction or "none"]  # the runtime fills in the mode's own
        self.bounds = Bounds(cfg.loss.tis_cap, cfg.loss.ratio_low, cfg.loss.ratio_high)
        self.advantage = ADVANTAGES[cfg.advantage or self.loss_fn.advantage]  # None: the loss's own
        self.device = self.flat.buffer.device
        # data parallel (train.world_size > 1): every rank runs `step` on the same groups, takes its
        # token-balanced share of the rows, and the gradients and metric sums are all-reduced
        dist = torch.distributed
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.micro = size_micro_batch(
            getattr(model, "config", None),
            cfg.bf16,
            self.flat.buffer.numel() + (self.critic.num_params() if self.critic else 0),
            rank_share(available_bytes(self.device), self.world, self.device.type == "cpu", trainers),
            cfg.memory_gb,
            cfg.micro_batch_tokens,
            cpu=self.device.type == "cpu",
            recompute=cfg.gradient_checkpointing,
            longest=longest,
        )
        if self.micro.recompute:  # the policy's layers, and the critic's, recomputed in the backward
            model.gradient_checkpointing = True
            if self.critic is not None:
                self.critic.model.gradient_checkpointing = True
        self.steps = 0
        if cfg.moe_aux_loss and not getattr(getattr(model, "config", None), "moe", False):
            raise ConfigError(
                f"train.moe_aux_loss={cfg.moe_aux_loss}: the policy has no mixture of experts to balance; "
                "set it to 0"
            )

    def step(self, groups: Sequence[Group], trainer_version: int) -> dict[str, Any]:
        """One train step over all `groups` (train.mini_batches x train.epochs optimizer updates);
        returns the step's metrics (plain floats)."""
        t0 = time.perf_counter()
        warm = self.steps < self.held  # the critic's warmup: the policy held, the critic trained alone
        for g in self.opt.param_groups:  # a function of the steps taken: a resume or a replay takes the same
            g["lr"] = self.schedule.lr_at(max(0, self.steps - self.held))
        if self.critic is not None:  # the critic's rate on the policy's warmup and decay
            for g in self.critic.opt.param_groups:
                g["lr"] = self.critic.lr * self.critic_schedule.lr_at(self.steps) / self.lr
        parts = mini_batches(groups, self.cfg.mini_batches)
        # a mini-batch whose every advantage is zero, with no KL or entropy term pulling on the weights
        # whatever the advantages, has a zero gradient: no passes, no update
        # (a critic's advantages, R - V, are never all zero)
        pulls = self.cfg.loss.kl_coef > 0 or self.cfg.loss.entropy_coef > 0 or self.critic is not None
        signal = [pulls or any(map(_has_signal, part)) for part in parts]
        if len(parts) > 1:  # the advantages are the step's, whatever mini-batch a group lands in
            parts = mini_batches(with_advantages(groups, self.advantage), self.cfg.mini_batches)
        batches = [self.make_batch(part, trainer_version) for part in parts]
        live = [b for b, s in zip(batches, signal) if s]
        if not live:
            self._advance()
            return self._metrics(_Sums(), batches, 0, [], time.perf_counter() - t0)
        self.model.eval()
        shards, positions = [self._shard(b) for b in live], [int(b.lengths.sum()) for b in live]
        chosen: dict[str, float] = {}
        if self.critic is not None:  # GAE's advantages from the critic's values before the updates
            totals = [float(b.mask.sum()) for b in live]
            shards, chosen = self.critic.prepare(
                shards, totals, self.micro.tokens, self._autocast, self.world
            )
        if not warm and (len(parts) > 1 or self.cfg.epochs > 1 or self.cfg.loss.top_entropy < 1):
            # every update's anchor: the policy before the first; and the tokens it is most unsure of
            prepared = [self._proximal(s) for s in shards]
            shards = [s for s, _ in prepared]
            if self.cfg.loss.top_entropy < 1:
                shards, picked = self._top_entropy(prepared)
                chosen.update(picked)
        acc, n_micro, norms = _Sums(), 0, []
        for _ in range(self.cfg.epochs):
            for shard, n_pos in zip(shards, positions):
                if warm:
                    self._critic_update(shard, acc)
                    continue
                n, norm = self._update(shard, n_pos, acc, len(norms), len(shards) * self.cfg.epochs)
                n_micro += n
                norms.append(norm)
        if warm:
            chosen["critic_warmup"] = 1
        self._advance()
        metrics = self._metrics(acc, batches, n_micro, norms, time.perf_counter() - t0, self.cfg.epochs)
        return {**metrics, **chosen}

    def _update(
        self, shard: TrainBatch, positions: int, acc: _Sums, done: int, updates: int
    ) -> tuple[int, float]:
        """One optimizer update over this rank's rows of a mini-batch; returns its micro-batches (all
        ranks') and its gradient norm. `done` of the step's `updates` were applied before it."""
        self.opt.zero_grad(set_to_none=True)
        sums = _Sums()
        micro = shard.micro_batches(self.micro.tokens)
        for mb in micro:
            self._forward_backward(mb.to(self.device), sums, True, positions)
        params = [p for p in self.model.parameters() if p.requires_grad]
        n_micro = self._all_reduce(params, sums, len(micro)) if self.world > 1 else len(micro)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip or math.inf))
        loss = sums.get("loss")
        critic: dict[str, float] = {}
        if self.critic is not None:  # its update on the same rows, stepped only if both are finite
            critic = self._critic_grads(shard)
        if not all(map(math.isfinite, (loss, grad_norm, *critic.values()))):
            self.opt.zero_grad(set_to_none=True)
            if self.critic is not None:
                self.critic.opt.zero_grad(set_to_none=True)
            of_critic = (
                f", the critic's value loss ({critic['value_loss']}) or its gradient norm "
                f"({critic['critic_grad_norm']})"
                if critic
                else ""
            )
            which = (
                f"update {done + 1} of {updates} was not applied and the step's weights not published (the "
                f"{done} before it moved the trainer's own copy only)"
                if done
                else "the step was not applied and its weights not published"
            )
            raise NonFiniteError(
                f"step {self.steps + 1}: the loss ({loss}), the gradient norm ({grad_norm}){of_critic} is "
                f"not finite, so {which}; lower train.lr (or check train.temperature and the rewards) and "
                "start again"
            )
        self.opt.step()
        if self.critic is not None:
            self._critic_step(critic, acc)
        acc.merge(sums)
        return n_micro, grad_norm

    def _critic_update(self, shard: TrainBatch, acc: _Sums) -> None:
        """The critic's update alone on a mini-batch's rows (train.critic.warmup_steps: the policy held)."""
        got = self._critic_grads(shard)
        if not all(map(math.isfinite, got.values())):
            self.critic.opt.zero_grad(set_to_none=True)
            raise NonFiniteError(
                f"step {self.steps + 1} (the critic's warmup): its value loss ({got['value_loss']}) or gradient "
                f"norm ({got['critic_grad_norm']}) is not finite, so the step was not applied; lower "
                "train.critic.lr (or check the rewards) and start again"
            )
        self._critic_step(got, acc)

    def _critic_grads(self, shard: TrainBatch) -> dict[str, float]:
        """The critic's clipped gradient over a mini-batch's rows, and its figures (not yet stepped)."""
        got = self.critic.backward(shard, self.micro.tokens, self._autocast, self.world)
        got["critic_grad_norm"] = self.critic.clip_grad()
        return got

    def _critic_step(self, got: dict[str, float], acc: _Sums) -> None:
        """The critic's optimizer step, its figures added to the step's (one more critic update)."""
        self.critic.opt.step()
        for k, v in got.items():
            acc.add(k, torch.tensor(v, dtype=torch.float64))
        acc.add("critic_updates", torch.tensor(1.0, dtype=torch.float64))

    def _advance(self) -> None:
        """A step taken; every train.loss.ref_sync_steps of them the KL reference moves to the policy."""
        self.steps += 1
        n = self.cfg.loss.ref_sync_steps
        if n and self.steps % n == 0:
            self.sync_reference()

    @torch.no_grad()
    def sync_reference(self) -> None:
        """ref = alpha x policy + (1 - alpha) x ref (train.loss.ref_sync_alpha); a LoRA run's reference
        adapter becomes the policy's adapter (alpha 1, which its config requires)."""
        if self.ref_model is None:
            lora.set_reference(self.model, lora.adapter_of(self.model))
            return
        ours = dict(self.model.named_parameters())
        for name, r in self.ref_model.named_parameters():
            r.lerp_(ours[name].to(r.dtype), self.cfg.loss.ref_sync_alpha)

    def reference_state(self) -> dict[str, torch.Tensor] | None:
        """The KL reference's weights once a sync has moved them from the run's start (None before: the
        start's are the reference), for a checkpoint: the reference model's parameters, or a LoRA run's
        reference adapter (each adapted projection's `ref_A`, `ref_B`)."""
        n = self.cfg.loss.ref_sync_steps
        if not n or self.steps < n:
            return None
        if self.ref_model is not None:
            return {k: p.detach() for k, p in self.ref_model.named_parameters()}
        return {k: b for k, b in self.model.named_buffers() if k.endswith((".ref_A", ".ref_B"))}

    @torch.no_grad()
    def load_reference(self, state: dict[str, torch.Tensor]) -> None:
        """`reference_state`'s weights back into the reference (a resumed run's)."""
        if self.ref_model is not None:
            params = dict(self.ref_model.named_parameters())
            if params.keys() != state.keys():
                raise ValueError(f"the reference's {len(state)} tensors are not the model's {len(params)}")
            for k, t in state.items():
                params[k].copy_(t)
            return
        for k, t in state.items():
            module, name = self.model.get_submodule(k.rsplit(".", 1)[0]), k.rsplit(".", 1)[1]
            if not isinstance(module, lora.LoRALinear):
                raise ValueError(f"{k}: no adapted projection of the model holds it")
            setattr(module, name, t.to(device=module.lora_A.weight.device, dtype=module.lora_A.weight.dtype))

    @torch.no_grad()
    def _proximal(self, shard: TrainBatch) -> tuple[TrainBatch, torch.Tensor]:
        """`shard` with the current policy's logprobs of its targets (`prox_logp`), its micro-batches
        formed as the updates form them, so the first update's ratio is exactly 1; and the policy's
        entropy at each position (zeros unless train.loss.top_entropy asks for it)."""
        prox, ent = torch.zeros_like(shard.behav_logp), torch.zeros_like(shard.behav_logp)
        for rows, mb in shard.indexed_micro_batches(self.micro.tokens):
            mb = mb.to(self.device)
            with self._autocast(), replaying(self.model, mb.routes):
                logits = self.model(mb.input_ids)
            t = logits.shape[1]
            prox[rows, :t] = token_logprobs(logits, mb.targets, self.cfg.temperature).to(prox.device)
            if self.cfg.loss.top_entropy < 1:
                ent[rows, :t] = entropy_from_logits(logits, self.cfg.temperature).float().to(ent.device)
        return dataclasses.replace(shard, prox_logp=prox), ent

    def _top_entropy(self, kept: list[tuple[TrainBatch, torch.Tensor]]) -> tuple[list[TrainBatch], dict]:
        """The shards with the loss's share (`scale`) taken from every live token whose entropy lies
        below the step's top train.loss.top_entropy share: the quantile over every rank's live tokens of
        every mini-batch. Returns them and the step's figures (the share kept, the threshold)."""
        live = torch.cat([e[s.mask > 0] for s, e in kept])
        if self.world > 1:  # every rank's, for one threshold
            sizes = [torch.zeros((), dtype=torch.long) for _ in range(self.world)]
            torch.distributed.all_gather(sizes, torch.tensor(live.numel()))
            pad = torch.full((int(max(sizes)),), math.nan)
            pad[: live.numel()] = live
            got = [torch.empty_like(pad) for _ in range(self.world)]
            torch.distributed.all_gather(got, pad)
            live = torch.cat([g[: int(n)] for g, n in zip(got, sizes)])
        if not live.numel():
            return [s for s, _ in kept], {}
        thr = float(torch.quantile(live.double(), 1.0 - self.cfg.loss.top_entropy))
        shards = [dataclasses.replace(s, scale=s.scale * (e >= thr)) for s, e in kept]
        return shards, {"entropy_kept": float((live >= thr).double().mean()), "entropy_threshold": thr}

    @torch.no_grad()
    def evaluate(self, groups: Sequence[Group], trainer_version: int) -> dict[str, Any]:
        """The metrics `step` would report for these groups, without changing any weight."""
        t0 = time.perf_counter()
        batch = self.make_batch(groups, trainer_version)
        if self.critic is not None:  # the whole batch on every rank: its own sums
            (batch,), _ = self.critic.prepare(
                [batch], [float(batch.mask.sum())], self.micro.tokens, self._autocast, 1
            )
        self.model.eval()
        acc = _Sums()
        micro, positions = batch.micro_batches(self.micro.tokens), int(batch.lengths.sum())
        for mb in micro:
            self._forward_backward(mb.to(self.device), acc, False, positions)
        return self._metrics(acc, [batch], len(micro), [math.nan], time.perf_counter() - t0)

    def _shard(self, batch: TrainBatch) -> TrainBatch:
        """This rank's rows: the batch split by tokens across ranks (the whole batch on one rank). The
        loss's `scale` is the whole batch's, so the ranks' summed gradients are the single-process one."""
        if self.world == 1:
            return batch
        return batch.rows(split_by_tokens(batch.lengths.tolist(), self.world)[self.rank])

    def _all_reduce(self, params: list[nn.Parameter], acc: _Sums, n_micro: int) -> int:
        """Sum the ranks' gradients (one flat all-reduce) and metric sums, max their peaks; returns
        the micro-batches of all ranks."""
        dist = torch.distributed
        all_reduce_grads(params)
        zero = torch.zeros((), device=self.device)
        sums = torch.stack([acc.sum.get(k, zero).float() for k in SUM_KEYS] + [torch.tensor(float(n_micro))])
        peaks = torch.stack([acc.max.get(k, torch.tensor(-math.inf)).float() for k in PEAK_KEYS])
        dist.all_reduce(sums)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        acc.sum = {k: v for k, v in zip(SUM_KEYS, sums[:-1]) if k in acc.sum or v != 0}
        acc.max = {k: v for k, v in zip(PEAK_KEYS, peaks) if v > -math.inf}
        return int(sums[-1])

    def make_batch(self, groups: Sequence[Group], trainer_version: int) -> TrainBatch:
        return batch_of(groups, self.cfg, trainer_version, getattr(self.model, "config", None))

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def _forward_backward(self, mb: TrainBatch, acc: _Sums, backward: bool, positions: int) -> None:
        """One micro-batch's forward (and backward); `positions`: the whole batch's real positions, of
        which the load-balancing loss takes this micro-batch's share."""
        cfg, lc = self.cfg, self.cfg.loss
        n_live = mb.mask.sum()
        resp = mb.versions >= 0
        valid = None  # the load-balancing loss's rows: the real positions, padding left out
        if cfg.moe_aux_loss:
            valid = torch.arange(mb.input_ids.shape[1], device=mb.lengths.device) < mb.lengths[:, None]
        with (
            self._autocast(),
            replaying(self.model, mb.routes),  # the engine's experts, where replayed
            balancing(self.model, valid) as stats,
        ):
            logits = self.model(mb.input_ids)  # (b, t, V)
        logp = token_logprobs(logits, mb.targets, cfg.temperature)  # (b, t) fp32
        # one update a step: the pre-update policy is the current one; several: the step's first
        prox = logp.detach() if mb.prox_logp is None else mb.prox_logp
        corr = self.correct(mb.behav_logp, prox, mb.mask, self.bounds)
        pg, st = self.loss_fn(
            logp,
            corr.old_logp,
            mb.adv,
            mb.mask,
            corr.weight,
            eps_low=lc.eps_low,
            eps_high=lc.eps_high,
            scale=mb.scale,
            clip_c=lc.clip_c,
        )
        loss = pg
        if stats:  # the load-balancing loss, this micro-batch's share of the batch's by its real tokens
            aux = balance_loss(stats, self.model.config.num_experts) * (valid.sum() / positions)
            loss = loss + cfg.moe_aux_loss * aux
            acc.add("moe_aux_loss", aux.detach())
        if lc.kl_coef > 0:
            ref = self.model if self.ref_model is None else self.ref_model
            off = lora.as_reference(ref) if self.ref_model is None else contextlib.nullcontext()
            with torch.no_grad(), self._autocast(), off:
                ref_logp = token_logprobs(ref(mb.input_ids), mb.targets, cfg.temperature)
            kl = kl_penalty(logp, ref_logp, mb.mask, mb.scale, lc.kl_type)
            loss = loss + lc.kl_coef * kl
            acc.add("kl", kl.detach())
        # the entropy at each position: with a bonus, through the graph; else a metric of detached logits
        ent = entropy_from_logits(logits if lc.entropy_coef > 0 else logits.detach(), cfg.temperature)
        if lc.entropy_coef > 0:
            bonus = aggregated(ent, mb.mask, mb.scale)
            loss = loss - lc.entropy_coef * bonus
            acc.add("entropy_bonus", bonus.detach())
        if backward and bool(n_live > 0):
            loss.backward()
        with torch.no_grad():
            live = mb.mask > 0
            same = resp & (mb.versions == mb.trainer_version)  # same weights: gap is pure numerics
            gap = (prox - mb.behav_logp).abs()
            w = torch.where(live, (prox - mb.behav_logp).exp(), 0.0)  # the importance ratio pi_prox/pi_behav
            acc.add("is_ratio", w.sum())
            acc.peak("is_ratio_max", w.max())
            acc.add("loss", loss.detach())
            acc.add("pg_loss", pg.detach())
            for k in ("clip_frac", "approx_kl", "ratio_mean", "dual_clip_frac"):
                if k in st:  # dual_clip_frac: PPO's min objective's alone
                    acc.add(k, st[k] * st["tokens"])
            acc.peak("ratio_max", st["ratio_max"])
            acc.add("tokens", n_live)
            acc.add("dropped", ((corr.keep == 0) & live).sum())
            acc.add("entropy", (ent.detach() * mb.mask).sum())
            acc.add("gap_sum", torch.where(same, gap, 0.0).sum())
            acc.peak("gap_max", torch.where(same, gap, 0.0).max())
            acc.add("gap_tokens", same.sum())

    def _metrics(
        self,
        acc: _Sums,
        batches: list[TrainBatch],
        n_micro: int,
        norms: list[float],
        dt: float,
        passes: int = 1,
    ) -> dict[str, Any]:
        """`acc` sums the `passes` over the batches (train.epochs): the per-token figures are means over
        them; `tokens` counts each live token once."""
        tok = acc.get("tokens")

        def per_tok(k: str) -> float:
            return acc.get(k) / tok if tok else 0.0

        def per_update(k: str) -> float:  # each update's loss has its own normaliser: their mean
            return acc.get(k) / max(1, len(norms))

        def per_critic_update(k: str) -> float:  # (the critic's warmup updates it alone)
            return acc.get(k) / max(1.0, acc.get("critic_updates"))

        sampled = sum(int((b.versions >= 0).sum()) for b in batches)
        trained = int(tok or acc.get("vf_tokens")) // passes  # (the critic's warmup: the critic's)

        gap_n = acc.get("gap_tokens")
        return {
            "step": self.steps,
            "loss": per_update("loss"),
            "pg_loss": per_update("pg_loss"),
            "kl": per_update("kl"),
            "clip_frac": per_tok("clip_frac"),
            "approx_kl": per_tok("approx_kl"),
            "ratio_mean": per_tok("ratio_mean"),
            "ratio_max": acc.get("ratio_max"),
            "dropped_frac": per_tok("dropped"),
            "is_ratio_mean": per_tok("is_ratio"),
            "is_ratio_max": acc.get("is_ratio_max"),
            "grad_norm": sum(norms) / len(norms) if norms else 0.0,  # their mean over the updates
            "entropy": per_tok("entropy"),
            "logprob_gap_mean": acc.get("gap_sum") / gap_n if gap_n else math.nan,
            "logprob_gap_max": acc.get("gap_max") if gap_n else math.nan,
            "gap_tokens": int(gap_n),
            "tokens": trained,
            "stale_tokens": sampled - trained,
            "sequences": sum(b.num_seqs for b in batches),
            # (a critic's advantages are per token and whitened: no sequence's own)
            **({} if self.critic else {"adv_mean": float(torch.cat([b.seq_adv for b in batches]).mean())}),
            "micro_batches": n_micro,
            "micro_batch_tokens": self.micro.tokens,
            "gradient_checkpointing": int(self.micro.recompute is not None),
            "updates": len(norms),  # optimizer updates taken: train.mini_batches x train.epochs, less the
            # mini-batches without reward signal
            # 1: no group had a reward signal, so no forward/backward ran
            "skipped": int(not norms and not acc.get("critic_updates")),
            "lr": self.opt.param_groups[0]["lr"],
            "time_s": dt,
            **take_load(self.model),  # a mixture of experts' routing: how even, how many experts idle
            **_replayed(batches),
            **({"moe_aux_loss": per_update("moe_aux_loss")} if self.cfg.moe_aux_loss else {}),
            **({"entropy_bonus": per_update("entropy_bonus")} if self.cfg.loss.entropy_coef else {}),
            **({"dual_clip_frac": per_tok("dual_clip_frac")} if self.cfg.loss.clip_c is not None else {}),
            **(
                {
                    "value_loss": per_critic_update("value_loss"),
                    "vf_clip_frac": acc.get("vf_clipped") / max(1.0, acc.get("vf_tokens")),
                    "critic_grad_norm": per_critic_update("critic_grad_norm"),
                    "critic_lr": self.critic.lr,
                }
                if self.critic is not None
                else {}
            ),
        }

    # -- checkpoints and weight transfer -----------------------------------------------------

    def adapter(self) -> lora.Adapter:
        """The LoRA adapter's current weights (copies); only with train.lora.rank > 0."""
        return lora.adapter_of(self.model)

    def state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.steps}
        return state | ({"critic": self.critic.state_dict()} if self.critic is not None else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`state_dict`'s; without a "critic" entry a critic keeps the weights it started with."""
        self.model.load_state_dict(state["model"])  # copies into the flat buffer's views
        self.opt.load_state_dict(state["optimizer"])
        self.steps = int(state["step"])
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])


def _replayed(batches: list[TrainBatch]) -> dict[str, float]:
    """Routing replay: the share of the batches' sampled tokens whose routes the engine recorded (a
    trajectory read back from the journal has none: the trainer routes it afresh)."""
    if batches[0].routes is None:
        return {}
    sampled = sum(int((b.versions >= 0).sum()) for b in batches)
    routed = sum(int(((b.routes[:, :, 0, 0] >= 0) & (b.versions >= 0)).sum()) for b in batches)
    return {"routes_replayed": routed / max(1, sampled)}


def mini_batches(groups: Sequence[Group], k: int) -> list[Sequence[Group]]:
    """`groups` in order, cut into min(k, len(groups)) runs whose sizes differ by one at most."""
    k = max(1, min(k, len(groups)))
    q, r = divmod(len(groups), k)
    cuts = [i * q + min(i, r) for i in range(k + 1)]
    return [groups[a:b] for a, b in zip(cuts, cuts[1:])]


def batch_of(
    groups: Sequence[Group], cfg: TrainerConfig, trainer_version: int, model: ModelConfig | None = None
) -> TrainBatch:
    """`groups` as a trainer of `cfg` trains them: its loss's aggregation, its advantage estimator (the
    loss's own when `advantage` is null), its staleness mask and padding (an external trainer's batches
    too: tailrace/client.py), and with `routing_replay` the routes the engine recorded for `model`."""
    loss = LOSSES[cfg.loss.name]
    return TrainBatch.from_groups(
        groups,
        trainer_version=trainer_version,
        token_scale=loss.token_scale,
        advantage=ADVANTAGES[cfg.advantage or loss.advantage],
        max_new_tokens=cfg.loss.max_new_tokens,
        max_staleness=cfg.max_staleness,
        pad_id=cfg.pad_id,
        moe=model if cfg.routing_replay and model is not None and model.moe else None,
        mask_truncated=cfg.mask_truncated,
    )
