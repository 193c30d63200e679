"""The trainer in its own process, pinned to its own core(s).

It takes `TrainOrder`s in order: one optimizer step each; when the order publishes a version, the
flat weights are copied into the shared-memory ring (one memcpy, timed); when it names a checkpoint
directory, model + optimizer + step + RNG state are written there before the reply goes out, so a
reply with `saved` set means the step is durable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tailrace.config import TrainerConfig
from tailrace.model.checkpoint import load_pretrained, save_pretrained
from tailrace.runtime.messages import Ready, Shutdown, TrainerReport, TrainOrder
from tailrace.runtime.procs import pin
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
    resume_from: str | None = None  # checkpoint dir holding trainer.pt
    start_version: int = 0
    device: str = "cpu"


def save_checkpoint(trainer: GRPOTrainer, model, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {"trainer": trainer.state_dict(), "rng": torch.get_rng_state()}
    tmp = out / "trainer.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(out / "trainer.pt")
    save_pretrained(model, out / "model")


def trainer_main(conn, counter, spec: TrainerSpec, weights: SharedWeights) -> None:
    with serving(conn, counter):
        _serve(spec, conn, weights)


def _serve(spec: TrainerSpec, conn, weights: SharedWeights) -> None:
    pin(spec.cores)
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    model = load_pretrained(spec.model_path, dtype=torch.float32, device=spec.device)
    trainer = GRPOTrainer(model, spec.cfg)
    if spec.resume_from:
        state = torch.load(Path(spec.resume_from) / "trainer.pt", weights_only=False)
        trainer.load_state_dict(state["trainer"])
        torch.set_rng_state(state["rng"])
    weights.write(spec.start_version, trainer.flat.buffer)
    conn.send(Ready(spec.start_version))
    while True:
        order: TrainOrder | Shutdown = conn.recv()
        if isinstance(order, Shutdown):
            return
        t = order.train
        t0 = time.perf_counter()
        metrics = trainer.step(list(t.groups), t.trainer_version)
        t1 = time.perf_counter()
        sync = None
        if t.publish is not None:
            weights.write(t.publish, trainer.flat.buffer)
            sync = (t1, time.perf_counter())
            metrics["weight_sync_s"] = sync[1] - sync[0]
        if order.save_dir:
            save_checkpoint(trainer, model, Path(order.save_dir))
        conn.send(TrainerReport(t.step, metrics, t.publish, order.save_dir, (t0, t1), sync))
