"""A LoRA trainer step against a full one on the same checkpoint and batch, taking turns.

    .venv/bin/python bench/lora_trainer.py --model DIR                        # 128 sequences x 64 tokens
    .venv/bin/python bench/lora_trainer.py --model DIR --seqs 16 --tokens 128 --rank 8

Three `GRPOTrainer`s in bf16 autocast (the runtime's `train.bf16=true`): full (every weight trained,
fp32 master weights), LoRA with its frozen base in fp32 ("lora, base fp32"), and LoRA as the trainer
builds it, the adapted projections' base weights kept in bf16 (`lora.store_frozen_projections`). The
same batch as bench/trainer.py (16-token prompts, rewards alternating); one warm-up step each, then
`--repeats` steps each in turn; CPU seconds of the calling thread, median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from trainer import groups  # noqa: E402

from tailrace.config import TrainerConfig  # noqa: E402
from tailrace.config.train import LoraConfig  # noqa: E402
from tailrace.model import lora  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.trainer.grpo import GRPOTrainer  # noqa: E402


def build(model_dir: str, rank: int, store: bool) -> GRPOTrainer:
    keep = lora.store_frozen_projections
    if not store:
        lora.store_frozen_projections = lambda *a: 0
    try:
        model = load_pretrained(model_dir, dtype=torch.float32)
        cfg = TrainerConfig(bf16=True, micro_batch_tokens=8192, lora=LoraConfig(rank=rank))
        return GRPOTrainer(model, cfg)
    finally:
        lora.store_frozen_projections = keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    trainers = {
        "full": build(a.model, 0, False),
        "lora, base fp32": build(a.model, a.rank, False),
        "lora": build(a.model, a.rank, True),
    }
    batch = groups(a.seqs, a.tokens, trainers["full"].model.config.vocab_size)
    for t in trainers.values():
        t.step(batch, 0)
    cpu: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(a.repeats):
        for k, t in trainers.items():
            c0 = time.thread_time()
            t.step(batch, 0)
            cpu[k].append(time.thread_time() - c0)
    full = statistics.median(cpu["full"])
    print(f"{a.model}: {a.seqs} x {a.tokens} tokens, bf16 autocast, LoRA rank {a.rank} on every projection")
    for k, v in cpu.items():
        print(
            f"  {k:16s} {statistics.median(v):7.3f} s CPU a step   {statistics.median(v) / full:5.2f}x full's"
        )


if __name__ == "__main__":
    main()
