"""What an architecture's extras cost the engine's decode: the same shape as Llama and as Qwen3 (its
per-head q/k RMSNorms), side by side in one process, alternated, best of `--repeats`.

    .venv/bin/python bench/arch_cost.py                  # hidden 512, 8 layers, heads of 128, ~1 min
    .venv/bin/python bench/arch_cost.py --layers 28 --hidden 1024 --heads 16 --kv-heads 8   # Qwen3-0.6B's

Random weights (seeded), fp32, one thread, 64 slots; each batch size B sends B requests of 16 prompt
tokens and 64 new tokens at temperature 1 (seeded, so both models decode the same number of tokens).
Prints tokens/s per model and batch, and Qwen3 / Llama.
"""

from __future__ import annotations

import argparse
import time

import torch

from tailrace.engine import TailraceEngine
from tailrace.model import CausalLM, ModelConfig
from tailrace.types import GenRequest, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    shape = dict(vocab_size=4096, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                 num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                 max_position_embeddings=1024, tie_word_embeddings=True)  # fmt: skip
    engines = {
        t: TailraceEngine(
            CausalLM.from_config(ModelConfig(model_type=t, **shape), seed=0).eval(), num_slots=64
        )
        for t in ("llama", "qwen3")
    }
    print(f"backend {engines['qwen3'].backend}; {shape}")
    for b in map(int, a.batches.split(",")):
        reqs = [
            GenRequest(
                f"r{i}", tuple(range(1, 17)), SamplingParams(max_new_tokens=64, temperature=1.0, seed=i)
            )
            for i in range(b)
        ]
        best: dict[str, float] = {}
        for _ in range(a.repeats):
            for t, eng in engines.items():
                t0 = time.perf_counter()
                n = sum(len(r.token_ids) for r in eng.generate(reqs))
                best[t] = max(best.get(t, 0.0), n / (time.perf_counter() - t0))
        ratio = best["qwen3"] / best["llama"]
        print(
            f"batch {b:3d}: llama {best['llama']:7.0f} tok/s  qwen3 {best['qwen3']:7.0f} tok/s  qwen3/llama {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
