"""What a mixture of experts costs a training step on CPU, and what padding each expert's rows buys.

    .venv/bin/python bench/moe_trainer.py            # the warm start's shape, bf16 autocast, ~1 min

The built-in model's shape (hidden 128, 4 layers, MLP 384) dense, and as Qwen3-MoE with 8 experts of
width 192, 2 a token (the warm-start recipe's MoE layout), forward and backward and an AdamW step under
bf16 autocast on one thread, over batches whose row count and length change every step (as SFT's and
GRPO's micro-batches do), so each expert's row count changes every step. `pad`: each expert's rows
padded to `common.padded_rows` (the decoder's choice on CPU in bf16), against running them as they come
(oneDNN compiles a bf16 kernel for every GEMM shape it meets; `--fp32`: no autocast, MKL's GEMMs, where
padding only adds rows). Prints seconds a step, best of `--repeats` passes, and the peak resident memory
each configuration reached, measured in a process of its own.
"""

from __future__ import annotations

import argparse
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import ArchConfig  # noqa: E402
from tailrace.model import CausalLM  # noqa: E402
from tailrace.model import moe as moe_module  # noqa: E402
from tailrace.runtime import warmstart  # noqa: E402
from tailrace.tokenizer import char_tokenizer  # noqa: E402

CONFIGS = ("dense", "moe-pad", "moe-nopad")


def run(which: str, steps: int, repeats: int, bf16: bool = True) -> tuple[float, int]:
    """(best seconds a step, peak RSS KiB) of `which`, under bf16 autocast or in fp32."""
    torch.set_num_threads(1)
    tok = char_tokenizer()
    cfg = warmstart.model_config(ArchConfig(), tok.vocab_size, tok)
    if which != "dense":
        cfg = cfg.replace(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                          norm_topk_prob=True)  # fmt: skip
    if which != "dense":  # the decoder's call, with the padding forced on or off
        mix = moe_module.mix
        moe_module.mix = lambda *a, pad=False, **kw: mix(*a, pad=which == "moe-pad", **kw)
    model = CausalLM.from_config(cfg, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(0)
    shapes = [(rng.randrange(4, 13), rng.randrange(60, 200)) for _ in range(steps)]
    best = float("inf")
    for rep in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        for rows, length in shapes:
            ids = torch.randint(
                3, tok.vocab_size, (rows, length), generator=torch.Generator().manual_seed(rows)
            )
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(ids)
            logits.float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
        if rep:
            best = min(best, (time.perf_counter() - t0) / steps)
    return best, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--fp32", action="store_true", help="no autocast: fp32 GEMMs (MKL, no kernel per shape)")
    p.add_argument("--only", choices=CONFIGS, help="one configuration, in this process (the others run it)")
    a = p.parse_args()
    if a.only:
        print(*run(a.only, a.steps, a.repeats, bf16=not a.fp32))
        return
    out = {}
    for which in CONFIGS:
        argv = [sys.executable, __file__, f"--only={which}", f"--steps={a.steps}", f"--repeats={a.repeats}"]
        argv += ["--fp32"] if a.fp32 else []
        r = subprocess.run(argv, capture_output=True, text=True, check=True)
        s, kib = r.stdout.split()
        out[which] = (float(s), int(kib))
    for which, (s, kib) in out.items():
        print(
            f"{which:10s} {s * 1e3:7.1f} ms a step  ({s / out['dense'][0]:.2f}x dense)  peak RSS {kib / 1024:,.0f} MiB"
        )
    print(
        f"{'fp32' if a.fp32 else 'bf16 autocast'}: padding {out['moe-nopad'][0] / out['moe-pad'][0]:.2f}x faster"
    )


if __name__ == "__main__":
    main()
