"""Trainer measurements: optimizer steps over synthetic groups of several shapes, and the
checkpoint a publishing step writes."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from tailrace.calibrate.models import random_trainer
from tailrace.config import ArchConfig
from tailrace.sim.costs import CostModel
from tailrace.sim.hardware import CPU_FALLBACK
from tailrace.sim.models import ModelShape
from tailrace.trainer.grpo import GRPOTrainer
from tailrace.types import Finish, GenResult, Group, Trajectory


def _traj(group: int, i: int, n: int, prompt: tuple[int, ...]) -> Trajectory:
    res = GenResult(f"{group}.{i}.0", (5,) * n, (-1.0,) * n, (0,) * n, Finish.STOP)
    return Trajectory(group, i, group, prompt, res, reward=float(i % 2), correct=bool(i % 2))


def measure_checkpoint(trainer: GRPOTrainer, repeats: int = 3) -> float:
    """Seconds the trainer worker spends writing its part of a checkpoint (model, optimizer, RNG)."""
    import tempfile

    from tailrace.runtime.checkpoint import save_trainer

    times = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(repeats):
            t0 = time.perf_counter()
            save_trainer(trainer, Path(d), Path(d) / f"step_{i}")  # no tokenizer files to copy
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


TRAIN_SHAPES = (
    (2, 32),
    (16, 64),
    (16, 128),
    (16, 256),
)  # (groups of 8, response length): small steps fix the intercept


def measure_train(
    cfg: ArchConfig,
    shape: ModelShape,
    shapes=TRAIN_SHAPES,
    k: int = 8,
    repeats: int = 3,
    trainer: GRPOTrainer | None = None,
) -> list[tuple[int, float, float]]:
    """(tokens, FLOPs, seconds) of real optimizer steps over synthetic groups."""
    trainer = trainer or random_trainer(cfg, torch.float32)
    prompt = (5,) * 16
    rows = []
    for groups, n in shapes:
        batch = [Group(g, g, tuple(_traj(g, i, n, prompt) for i in range(k))) for g in range(groups)]
        per_seq = len(prompt) + n
        flops = CostModel(CPU_FALLBACK, shape, recompute_logprobs=False).train_flops([per_seq] * groups * k)
        trainer.step(batch, 0)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            trainer.step(batch, 0)
            times.append(time.perf_counter() - t0)
        rows.append((groups * k * per_seq, flops, statistics.median(times)))
    return rows


def train_loop(cores, stop, ready, go, computing, dtype) -> None:
    """Child process of `measure_corun`: real optimizer steps on its own core while `go` is set
    (`computing` says whether it is), until `stop` is set."""
    from tailrace.runtime.procs import pin

    pin(cores)
    torch.set_num_threads(1)
    trainer = random_trainer(ArchConfig(), dtype)
    batch = [Group(g, g, tuple(_traj(g, i, 96, (5,) * 16) for i in range(8))) for g in range(8)]
    trainer.step(batch, 0)
    ready.set()
    while not stop.is_set():
        if go.is_set():
            computing.set()
            trainer.step(batch, 0)
        else:
            computing.clear()
            go.wait(0.05)
