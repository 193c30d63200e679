"""The trainer in its own process, pinned to its own core(s).

It takes `TrainOrder`s in order: one optimizer step each; when the order publishes a version, the
flat weights are copied into the shared-memory ring (one memcpy, timed); when it names a checkpoint
directory, the model (a whole HF checkpoint), optimizer and step are written there before the reply
goes out (runtime/checkpoint.py). A `replay` order redoes a step a lost trainer had done since its
last checkpoint: the optimizer moves, nothing is published or saved (engines may hold those weights).
A replacement trainer starts from that checkpoint and does not write its weights to the ring
(`publish_start`): a newer version may live in that slot. A step whose loss or gradient is not
finite raises before the optimizer moves (trainer/grpo.py): nothing of it is published or saved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tailrace.config import TrainerConfig
from tailrace.model import lora
from tailrace.model.checkpoint import load_pretrained
from tailrace.runtime import trainer_ranks
from tailrace.runtime.checkpoint import load_trainer, save_trainer
from tailrace.runtime.messages import Ready, Shutdown, TrainerReport, TrainOrder
from tailrace.runtime.procs import pin
from tailrace.runtime.shared_base import SharedBase
from tailrace.runtime.weights import SharedWeights
from tailrace.runtime.workers import serving
from tailrace.trainer.grpo import GRPOTrainer


@dataclass
class TrainerSpec:
    model_path: str
    cfg: TrainerConfig
    threads: int
    cores: tuple[int, ...]
    seed: int
    resume_from: str | None = None  # a checkpoint directory (runtime/checkpoint.py)
    start_version: int = 0
    device: str = "cpu"
    publish_start: bool = True  # write the start weights to the ring (a replacement does not)
    trainers: int = 1  # trainers sharing this machine's memory (several policies' on the local runtime)
    base: SharedBase | None = None  # a LoRA run's frozen base, one copy in shared memory for every trainer
    relay: str | None = None  # train.external: the run directory your trainer finds the relay by
    steps: int = 0  # the policy's flow.steps (the relay tells your trainer whether the run finished)
    longest: int = 0  # tokens of the run's longest training row (train.gradient_checkpointing=null)


def trainer_target(spec: TrainerSpec):
    """The trainer process's body: the built-in trainer, or the relay to your own (train.external)."""
    if spec.relay is None:
        return trainer_main
    from tailrace.runtime.relay import relay_main

    return relay_main


def build_trainer(spec: TrainerSpec) -> GRPOTrainer:
    """The trainer of `spec` (every data-parallel rank builds the same one): its start weights, the KL
    reference when the loss has one, and the checkpoint's optimizer state when it resumes."""
    torch.manual_seed(spec.seed)
    lora_run = bool(spec.cfg.lora.rank)  # the base never changes: a checkpoint's adapter/ is the policy
    start = Path(spec.resume_from) / "model" if spec.resume_from and not lora_run else spec.model_path
    if spec.base is not None and lora_run:
        model = spec.base.model()
    else:
        model = load_pretrained(start, dtype=torch.float32, device=spec.device)
    # train.lora.init: the start adapter (a resume takes its checkpoint's), and the KL reference's
    wants_init = spec.cfg.lora.init and (not spec.resume_from or spec.cfg.loss.kl_coef > 0)
    init = lora.load_peft(spec.cfg.lora.init, model.config) if wants_init else None
    ref = None
    # the KL penalty's reference: the policy the run started from (a LoRA run's: the trainer's own base
    # with its adapter off, or swapped for the adapter it started from; no copy)
    if spec.cfg.loss.kl_coef > 0 and not lora_run:
        ref = load_pretrained(spec.model_path, dtype=torch.float32, device=spec.device).requires_grad_(False)
    trainer = GRPOTrainer(
        model, spec.cfg, ref_model=ref, trainers=spec.trainers, total_steps=spec.steps, longest=spec.longest
    )
    if init is not None and spec.cfg.loss.kl_coef > 0:
        lora.set_reference(trainer.model, init)
    if spec.resume_from and lora_run:
        lora.load_adapter_into(
            trainer.model, lora.load_peft(Path(spec.resume_from) / lora.ADAPTER_DIR, model.config)
        )
    elif init is not None:
        lora.load_adapter_into(trainer.model, init)
    if spec.resume_from:
        load_trainer(trainer, Path(spec.resume_from))
    return trainer


def trainer_main(conn, counter, spec: TrainerSpec, weights: SharedWeights) -> None:
    with serving(conn, counter):
        pin(spec.cores)
        torch.set_num_threads(spec.threads)
        world = spec.cfg.world_size
        if world > 1:  # ranks 1..N-1 in processes of their own, then the process group
            init, ranks = trainer_ranks.start(spec, world)
            trainer_ranks.join(0, world, init, spec.device)
        trainer = build_trainer(spec)
        dp = f", {world} data-parallel ranks" if world > 1 else ""
        base = (
            f", the frozen base's projections in bf16 ({trainer.base_saved / 1e6:,.0f} MB saved)"
            if trainer.base_saved
            else ""
        )
        c = spec.cfg
        ppo = (
            f"; {c.mini_batches * c.epochs} optimizer updates a step ({c.mini_batches} "
            f"mini-batch{'es' * (c.mini_batches > 1)} x "
            f"{c.epochs} epoch{'s' * (c.epochs > 1)}), their ratios against the step's first policy"
            if c.mini_batches * c.epochs > 1
            else ""
        )
        critic = (
            f"; a critic ({trainer.critic.num_params() / 1e6:,.1f}M weights, the policy's as it started, "
            f"lr {trainer.critic.lr:.2g}; GAE gamma {c.critic.gamma:g} lambda {c.critic.lam:g}"
            + (f"; alone for the first {trainer.held} step{'s' * (trainer.held > 1)}" if trainer.held else "")
            + ")"
            if trainer.critic is not None
            else ""
        )
        lc = c.loss
        ref = (
            f"; the KL reference moves to the policy every {lc.ref_sync_steps} steps"
            + (f" (weight {lc.ref_sync_alpha:g})" if lc.ref_sync_alpha < 1 else "")
            if lc.ref_sync_steps
            else ""
        )
        print(f"trainer: {trainer.micro.describe()}{dp}{base}{ppo}{critic}{ref}", flush=True)
        if trainer.micro.short:
            print(f"warning: {trainer.micro.short}", flush=True)
        if spec.publish_start:
            weights.write(spec.start_version, trainer.flat.buffer)
        conn.send(Ready(spec.start_version))
        while not isinstance(order := conn.recv(), Shutdown):
            conn.send(_step(trainer, spec, order, weights))
        if world > 1:
            trainer_ranks.lead(None)
            for p in ranks:
                p.wait(timeout=60)
            trainer_ranks.cleanup(init)


def _step(
    trainer: GRPOTrainer, spec: TrainerSpec, order: TrainOrder, weights: SharedWeights
) -> TrainerReport:
    t = order.train
    t0 = time.perf_counter()
    if trainer.world > 1:
        trainer_ranks.lead((t.groups, t.trainer_version))
    # The step's activations stay in the C heap for the next step (they are within the activation
    # budget its micro-batches were sized by): trimming them after each step made every step fault
    # them back in, 1.25x the trainer's time over 24 identical seeded sync steps (bench/README.md).
    metrics = trainer.step(list(t.groups), t.trainer_version)
    t1 = time.perf_counter()
    sync = None
    if order.replay:
        return TrainerReport(t.step, metrics, None, None, (t0, t1), None, replay=True)
    if t.publish is not None:
        weights.write(t.publish, trainer.flat.buffer)
        sync = (t1, time.perf_counter())
        metrics["weight_sync_s"] = sync[1] - sync[0]
    save_s = 0.0
    if order.save_dir:
        s0 = time.perf_counter()
        save_trainer(trainer, Path(spec.model_path), Path(order.save_dir), merged=order.merged)
        save_s = time.perf_counter() - s0
    return TrainerReport(t.step, metrics, t.publish, order.save_dir, (t0, t1), sync, save_s)
