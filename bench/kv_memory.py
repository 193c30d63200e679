"""KV memory of an eval-shaped run: 64 slots on a random model with SmolLM2-135M's shape, one process.

    .venv/bin/python bench/kv_memory.py                       # 1 GiB budget, 64 x (64 + 64) tokens
    .venv/bin/python bench/kv_memory.py --kv-gb 0.25          # a pool too small for the batch: preempts
    .venv/bin/python bench/kv_memory.py --prompt 256 --new 256 --requests 128

The model is built from its config (Llama, hidden 576, 30 layers, 9 heads / 3 kv heads, head_dim 64,
vocab 49,152, max_position_embeddings 8,192, tied embeddings; random weights, no download), in fp32 as
`tailrace eval` loads it. Prints the pool the engine sized (its start-up line), what the unpaged
engine allocated for the same slots (slots x max_position_embeddings), the process's resident memory
after loading the model, after building the engine and at its peak after generating, and the
preemptions. Random prompts, exactly `--new` sampled tokens each.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.engine import TailraceEngine  # noqa: E402
from tailrace.engine.kv_budget import GIB  # noqa: E402
from tailrace.engine.kv_cache import KVCache  # noqa: E402
from tailrace.model.config import ModelConfig  # noqa: E402
from tailrace.model.decoder import CausalLM  # noqa: E402
from tailrace.types import GenRequest, SamplingParams  # noqa: E402

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def rss_gib(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS) or its peak (VmHWM), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GIB
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-gb", type=float, default=1.0, help="rollout.kv_memory_gb (0: the default share)")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = CausalLM.from_config(ModelConfig(**SMOLLM2_135M), seed=0).eval()
    params = sum(t.numel() for t in model.parameters())
    after_model = rss_gib()
    t0 = time.perf_counter()
    eng = TailraceEngine(model, num_slots=a.slots, kv_memory_gb=a.kv_gb or None, seed=0)
    after_engine = rss_gib()
    unpaged = (a.slots + 1) * 8192 * KVCache.token_bytes(model, torch.float32)
    print(f"model: {params / 1e6:.0f}M parameters, fp32; engine: {eng.describe()}")
    print(f"the unpaged engine allocated {unpaged / GIB:.2f} GiB of KV for {a.slots} slots x 8,192 positions")
    rng = random.Random(0)
    reqs = [
        GenRequest(
            f"e{i}",
            tuple(rng.randrange(model.config.vocab_size) for _ in range(a.prompt)),
            SamplingParams(max_new_tokens=a.new, min_new_tokens=a.new, seed=i),
        )
        for i in range(a.requests)
    ]
    out = eng.generate(reqs)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in out)
    print(
        f"KV allocated {eng.cache.nbytes() / GIB:.3f} GiB; resident: {after_model:.2f} GiB with the model, "
        f"{after_engine:.2f} GiB with the engine, peak {rss_gib('VmHWM'):.2f} GiB after generating "
        f"{tokens:,} tokens for {a.requests} requests of {a.prompt} + {a.new} ({eng.preemptions} preemptions, "
        f"{wall:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
