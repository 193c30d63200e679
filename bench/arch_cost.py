"""What an architecture's extras cost the engine's decode: the same shape as Llama, as Qwen3 (its
per-head q/k RMSNorms) and as OLMo2 (norms after attention and MLP, q/k normed over all heads), side by
side in one process, alternated, best of `--repeats`. `qwen3_moe` (with `--archs`): Qwen3's with each
MLP 16 experts of a quarter of its width, 4 a token (Qwen3-30B-A3B's proportions): the same active
weights a token, four times the MLP weights in all. `qwen2_moe`: Qwen2's attention (biased q/k/v, no q/k
norms) with 16 experts of an eighth of the MLP's width, 4 a token, and a shared expert of half its width
(Qwen1.5-MoE-A2.7B's proportions: the shared expert four routed experts wide): the same active weights.

    .venv/bin/python bench/arch_cost.py                  # hidden 512, 8 layers, heads of 128, ~1 min
    .venv/bin/python bench/arch_cost.py --layers 28 --hidden 1024 --heads 16 --kv-heads 8   # Qwen3-0.6B's

Random weights (seeded), fp32 (or `--dtype bfloat16`), one thread, 64 slots; each batch size B sends B
requests of 16 prompt tokens and 64 new tokens at temperature 1 (seeded, so the models decode the same
number of tokens).
Prints tokens/s per model and batch, and each / Llama.
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
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--archs", default="llama,qwen3,olmo2", help="model types; the first is the baseline")
    a = p.parse_args()
    torch.set_num_threads(1)
    shape = dict(vocab_size=4096, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                 num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                 max_position_embeddings=1024, tie_word_embeddings=True)  # fmt: skip
    moe = dict(
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, moe_intermediate_size=3 * a.hidden // 4
    )
    shared = dict(moe, norm_topk_prob=False, moe_intermediate_size=3 * a.hidden // 8,
                  shared_expert_intermediate_size=3 * a.hidden // 2)  # fmt: skip
    extra = {"qwen3_moe": moe, "qwen2_moe": shared}  # the family's own fields, beside the shape all share
    engines = {
        t: TailraceEngine(
            CausalLM.from_config(ModelConfig(model_type=t, **shape, **extra.get(t, {})), seed=0)
            .to(getattr(torch, a.dtype))
            .eval(),
            num_slots=64,
        )
        for t in a.archs.split(",")
    }
    base = next(iter(engines))
    print(f"backend {engines[base].backend}, {a.dtype}; {shape}")
    for b in map(int, a.batches.split(",")):
        reqs = [
            GenRequest(
                f"r{i}", tuple(range(1, 17)), SamplingParams(max_new_tokens=64, temperature=1.0, seed=i)
            )
            for i in range(b)
        ]
        best: dict[str, float] = {}
        names = list(engines)
        for rep in range(a.repeats):  # each model first in turn: the first of a round ran ~5% slower
            for t in names[rep % len(names) :] + names[: rep % len(names)]:
                t0 = time.perf_counter()
                n = sum(len(r.token_ids) for r in engines[t].generate(reqs))
                best[t] = max(best.get(t, 0.0), n / (time.perf_counter() - t0))
        cols = "  ".join(f"{t} {best[t]:6.0f} tok/s" for t in names)
        ratios = "  ".join(f"{t}/{base} {best[t] / best[base]:.3f}" for t in names[1:])
        print(f"batch {b:3d}: {cols}  |  {ratios}")


if __name__ == "__main__":
    main()
