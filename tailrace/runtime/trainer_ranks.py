"""Data-parallel trainer ranks (train.world_size > 1).

Rank 0 is the trainer worker the driver talks to; it starts ranks 1..N-1 as processes of their own
(`python -m tailrace.runtime.trainer_ranks`), which die with it (PR_SET_PDEATHSIG), and they meet in
a gloo (CPU) or NCCL (GPU) process group. Every rank builds the same model from the same start (the
run's model or its resume checkpoint); before each optimizer step rank 0 broadcasts the step's groups
and trainer version, every rank runs `GRPOTrainer.step` on its token-balanced share of the rows, and
the gradients are all-reduced (trainer/grpo.py), so every rank holds the same weights after it. Only
rank 0 publishes weights and writes checkpoints. A rank that dies makes the others' collective fail:
rank 0 raises, and the driver replaces the trainer as it would a single one.
"""

from __future__ import annotations

import ctypes
import datetime
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

TIMEOUT = datetime.timedelta(minutes=5)  # a collective that waits longer on a rank raises


def start(spec, world: int) -> tuple[str, list[subprocess.Popen]]:
    """Start ranks 1..world-1 for trainer `spec`; returns the process group's init method and them."""
    tmp = Path(tempfile.mkdtemp(prefix="tailrace-ranks-"))
    init = f"file://{tmp / 'rendezvous'}"
    (tmp / "spec.pickle").write_bytes(pickle.dumps(replace(spec, base=None)))  # each rank loads its base
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tailrace.runtime.trainer_ranks",
                str(tmp / "spec.pickle"),
                str(r),
                str(world),
                init,
            ],
            preexec_fn=_die_with_parent,
        )
        for r in range(1, world)
    ]
    return init, procs


def cleanup(init: str) -> None:
    """Remove what `start` wrote (the ranks' spec and the rendezvous file), once the ranks are done."""
    shutil.rmtree(Path(init.removeprefix("file://")).parent, ignore_errors=True)


def join(rank: int, world: int, init: str, device: str) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    torch.distributed.init_process_group(
        backend, init_method=init, rank=rank, world_size=world, timeout=TIMEOUT
    )


def lead(step: tuple[Sequence, int] | None) -> None:
    """Rank 0: tell the other ranks the next step's (groups, trainer version), or None: stop."""
    torch.distributed.broadcast_object_list([step], src=0)


def follow(trainer) -> None:
    """Ranks 1..N-1: run every step rank 0 leads, until it says stop."""
    while True:
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        groups, version = box[0]
        trainer.step(list(groups), version)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str]) -> None:
    from tailrace.runtime.trainer_worker import build_trainer

    spec_file, rank, world, init = argv[0], int(argv[1]), int(argv[2]), argv[3]
    spec = pickle.loads(Path(spec_file).read_bytes())
    torch.set_num_threads(spec.threads)
    join(rank, world, init, spec.device)
    try:
        follow(build_trainer(spec))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
