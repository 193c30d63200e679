"""One GRPO trainer step on a real checkpoint, profiled, against the GEMM limit of its shape.

    .venv/bin/python bench/trainer.py --model DIR                  # 16 sequences x 128 tokens, fp32 and bf16
    .venv/bin/python bench/trainer.py --model DIR --seqs 8 --tokens 64 --dtypes bf16

The step is `GRPOTrainer.step` as the runtime runs it: fp32 master weights, the forward autocast to
bf16 for "bf16", forward + backward over `--seqs` sequences of `--tokens` tokens (16-token prompt, the
rest response; rewards alternate so every advantage is non-zero), gradient clipping, AdamW.
tokens/s = seqs * tokens / wall seconds of one step (median of `--repeats` after one warm-up); per
CPU-second likewise over the calling thread's CPU time (the comparable figure on a shared machine).

"gemm limit": the step's weight matmuls alone at that shape (per projection and the LM head: the
forward x W^T, and the backward's dX = dY W and dW = dY^T x), in the dtype the step runs them in, least
CPU time of the repeats: what the step would reach if it were nothing but those GEMMs. The profile
splits one step's CPU time by kind of op (the profiler adds microseconds per op, so small ops look
costlier than they are).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import TrainerConfig  # noqa: E402
from tailrace.config.train import LoraConfig  # noqa: E402
from tailrace.model import attention  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.trainer.grpo import GRPOTrainer  # noqa: E402
from tailrace.types import Finish, GenResult, Group, Trajectory  # noqa: E402

PROMPT_TOKENS = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-sdpa": torch.bfloat16}
# Ops of each kind, by self CPU time (they do not nest in one another); the optimizer by its whole step.
_KINDS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    (
        "attention",
        (
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        ),
    ),
    ("casts", ("aten::copy_",)),
    ("log-softmax", ("aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::logsumexp")),
)
_OPTIMIZER = "Optimizer.step#AdamW.step"
EAGER_MAX_T = attention.EAGER_MAX_T


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint dir")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128, help="tokens per sequence, prompt included")
    p.add_argument(
        "--dtypes",
        default="fp32,bf16",
        help="fp32, bf16 (on CPU: eager attention up to EAGER_MAX_T tokens), bf16-sdpa (bf16 with torch's SDPA, "
        "the path before 2026-12-02)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lora", type=int, default=0, help="train a LoRA adapter of this rank (every projection)")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    a.dtypes = a.dtypes.split(",")
    return a


def groups(seqs: int, tokens: int, vocab: int) -> list[Group]:
    """`seqs` trajectories in groups of up to 8, each a 16-token prompt and tokens - 16 response tokens."""
    n, out = tokens - PROMPT_TOKENS, []
    for g in range(math.ceil(seqs / 8)):
        trajs = []
        for i in range(min(8, seqs - 8 * g)):
            ids = tuple((7 * (g * 8 + i) + 13 * t) % (vocab - 4) + 4 for t in range(tokens))
            res = GenResult(f"{g}.{i}", ids[PROMPT_TOKENS:], (-1.0,) * n, (0,) * n, Finish.STOP)
            trajs.append(
                Trajectory(g, i, g, ids[:PROMPT_TOKENS], res, reward=float(i % 2), correct=bool(i % 2))
            )
        out.append(Group(g, g, tuple(trajs)))
    return out


def gemm_limit(model, rows: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """(seconds, FLOPs) of the step's weight GEMMs alone at `rows` tokens: every 2-D weight but the
    embedding, plus the (tied or not) LM head, forward and both backward products, in `dtype`."""
    shapes = [tuple(w.shape) for n, w in model.named_parameters() if w.ndim == 2 and "embed_tokens" not in n]
    if not any("lm_head" in n for n, _ in model.named_parameters()):
        shapes.append(tuple(model.model.embed_tokens.weight.shape))  # tied: the LM head reads the embedding
    g = torch.Generator().manual_seed(0)
    ops = []
    for N, K in set(shapes):
        w = torch.randn(N, K, generator=g).to(dtype)
        x = torch.randn(rows, K, generator=g).to(dtype)
        dy = torch.randn(rows, N, generator=g).to(dtype)
        ops.append((shapes.count((N, K)), w, x, dy))

    def step():
        for count, w, x, dy in ops:
            for _ in range(count):
                torch.mm(x, w.t())  # forward
                torch.mm(dy, w)  # dX
                torch.mm(dy.t(), x)  # dW

    step()
    best = math.inf
    for _ in range(max(repeats, 2)):
        c0 = time.thread_time()
        step()
        best = min(best, time.thread_time() - c0)
    return best, sum(6 * rows * N * K for N, K in shapes)


def profile_step(trainer: GRPOTrainer, batch: list[Group]) -> dict[str, float]:
    """Share of one step's CPU time by kind of op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(batch, 0)
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev)
    kinds = {k: sum(e.self_cpu_time_total for e in ev if e.key in names) for k, names in _KINDS}
    kinds["optimizer"] = sum(e.cpu_time_total for e in ev if e.key == _OPTIMIZER)
    kinds["other"] = max(0.0, total - sum(kinds.values()))
    return {k: v / total for k, v in kinds.items()}


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    tokens = a.seqs * a.tokens
    print(
        f"model {a.model} | threads {a.threads} | {a.seqs} sequences x {a.tokens} tokens | "
        f"load avg {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rows = []
    for dn in a.dtypes:
        attention.EAGER_MAX_T = 0 if dn == "bf16-sdpa" else EAGER_MAX_T
        model = load_pretrained(a.model, dtype=torch.float32)  # master weights; bf16 = autocast
        bf16 = DTYPES[dn] == torch.bfloat16
        trainer = GRPOTrainer(
            model,
            TrainerConfig(bf16=bf16, micro_batch_tokens=max(8192, tokens), lora=LoraConfig(rank=a.lora)),
        )
        batch = groups(a.seqs, a.tokens, model.config.vocab_size)
        trainer.step(batch, 0)  # warm-up
        wall, cpu = [], []
        for _ in range(a.repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            trainer.step(batch, 0)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        kinds = profile_step(trainer, batch)
        gemm_s, flops = gemm_limit(model, tokens, DTYPES[dn], a.repeats)
        r = {
            "dtype": dn,
            "tok_s": tokens / statistics.median(wall),
            "cpu_tok_s": tokens / statistics.median(cpu),
            "limit": tokens / gemm_s,
            "gemm_gflops": flops / gemm_s / 1e9,
            "kinds": kinds,
        }
        rows.append(r)
        print(
            f"  {dn}: step {statistics.median(wall):.1f} s, {r['tok_s']:,.0f} tok/s "
            f"({r['cpu_tok_s']:,.0f} per CPU-s), gemm limit {r['limit']:,.0f} tok/s "
            f"({r['gemm_gflops']:.0f} GFLOP/s), share {r['cpu_tok_s'] / r['limit']:.0%} | CPU by kind: "
            + ", ".join(f"{k} {v:.0%}" for k, v in kinds.items())
            + f" | load avg {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
