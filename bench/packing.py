"""The trainer's micro-batching: one GRPO step on a long-tailed RL batch, cut by the trainer's rule
(`trainer/packing.py`: fewest padded tokens plus a per-micro-batch cost) against filling each
micro-batch to its cap longest first (the rule before 2026-12-01), side by side in one process.

    .venv/bin/python bench/packing.py              # the built-in model, 16 x 8 chainsum-like rows
    .venv/bin/python bench/packing.py --model DIR --rows 64 --cap 4096

Rows: 16 prompts x 8 samples, prompts of 10-40 tokens, responses Pareto-tailed (alpha 1.3, scale 20,
at most 300 tokens: chainsum's p99/median ~6). Each call is a whole `GRPOTrainer.step` (forward,
backward, AdamW) at one torch thread; the two rules take turns call by call, so drift falls on both.
Printed: micro-batches, padded tokens over real ones, and CPU seconds per step (median), old / new.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tailrace.trainer.batch as batch_module  # noqa: E402
from tailrace.config import ArchConfig, SFTConfig, TrainerConfig  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.runtime.warmstart import ensure_warm_start  # noqa: E402
from tailrace.trainer.grpo import GRPOTrainer  # noqa: E402
from tailrace.trainer.packing import micro_batches  # noqa: E402
from tailrace.types import Finish, GenResult, Group, Trajectory  # noqa: E402


def fill_to_cap(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The rule before: rows longest first, each micro-batch filled while rows x longest <= the cap."""
    out: list[list[int]] = []
    cur: list[int] = []
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if cur and lengths[cur[0]] * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(b)
    return out + [cur] if cur else out


def rl_groups(vocab: int, prompts: int, samples: int, rng: random.Random) -> list[Group]:
    groups = []
    for g in range(prompts):
        prompt = tuple(rng.randrange(4, vocab) for _ in range(rng.randint(10, 40)))
        trajs = []
        for i in range(samples):
            n = min(300, int(rng.paretovariate(1.3) * 20))
            resp = tuple(rng.randrange(4, vocab) for _ in range(n))
            res = GenResult(f"{g}.{i}", resp, (-1.0,) * n, (0,) * n, Finish.STOP)
            trajs.append(Trajectory(g, i, g, prompt, res, float(i % 2), i % 2 == 1))
        groups.append(Group(g, g, tuple(trajs)))
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--cap", type=int, default=8192, help="train.micro_batch_tokens")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    path = a.model or ensure_warm_start(ArchConfig(), SFTConfig())
    model = load_pretrained(path)
    groups = rl_groups(model.config.vocab_size, a.prompts, a.samples, random.Random(0))
    trainer = GRPOTrainer(model, TrainerConfig(micro_batch_tokens=a.cap, lr=1e-9))
    lengths = trainer.make_batch(groups, 0).lengths.tolist()
    rules = {"old": fill_to_cap, "new": micro_batches}
    cpu: dict[str, list[float]] = {k: [] for k in rules}
    for r in range(a.rounds + 1):  # round 0 warms up
        for k in ("old", "new") if r % 2 else ("new", "old"):
            batch_module.micro_batches = rules[k]
            t = time.process_time()
            trainer.step(groups, 0)
            if r:
                cpu[k].append(time.process_time() - t)
    print(f"{len(lengths)} rows, {sum(lengths):,} tokens, cap {a.cap:,}")
    for k, rule in rules.items():
        mbs = rule(lengths, a.cap)
        pad = sum(len(m) * max(lengths[i] for i in m) for m in mbs)
        print(
            f"{k}: {len(mbs)} micro-batches, padded {pad / sum(lengths):.2f}x the tokens, "
            f"{statistics.median(cpu[k]):.3f} CPU s a step"
        )
    print(f"old / new CPU time: {statistics.median(cpu['old']) / statistics.median(cpu['new']):.2f}x")


if __name__ == "__main__":
    main()
