"""What attending to a sliding window saves the engine's decode: one model with a window (Mistral v0.1's
layout, every layer; or Gemma 3's, five sliding layers of six) against the same weights without one,
side by side in one process, alternated, best of `--repeats`.

    .venv/bin/python bench/window.py                          # Mistral's layout, window 256, ~2 min
    .venv/bin/python bench/window.py --layout gemma3 --attention bmm

Random weights (seeded), fp32, one thread; each batch size B sends B requests of `--prompt` tokens and
`--new` new tokens at temperature 1 (seeded). Prints tokens/s (prompt and generated tokens over the whole
`generate`) per model and batch, and the windowed one's / the windowless one's. The kernel backend reads
only a token's window from the cache (the whole blocks before it skipped); the torch backend gathers every
position and masks those before the window, so it saves nothing there.
"""

from __future__ import annotations

import argparse
import time

import torch

from tailrace.engine import TailraceEngine
from tailrace.model import CausalLM, ModelConfig
from tailrace.types import GenRequest, SamplingParams


def configs(layout: str, window: int, shape: dict) -> tuple[ModelConfig, ModelConfig]:
    """(windowed, windowless) configs of one layout: the latter has every layer full."""
    if layout == "mistral":
        return ModelConfig(model_type="mistral", sliding_window=window, **shape), ModelConfig(
            model_type="mistral", **shape
        )
    n = shape["num_hidden_layers"]
    kinds = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n))
    gemma = dict(model_type="gemma3_text", local_rope={"rope_theta": 1e4}, rope_theta=1e6, **shape)
    return ModelConfig(sliding_window=window, layer_types=kinds, **gemma), ModelConfig(
        layer_types=("full_attention",) * n, **gemma
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="mistral", choices=["mistral", "gemma3"])
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--prompt", type=int, default=1536)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention", default="kernel", choices=["kernel", "bmm"])
    a = p.parse_args()
    torch.set_num_threads(1)
    shape = dict(vocab_size=4096, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                 num_attention_heads=a.hidden // 128, num_key_value_heads=max(1, a.hidden // 256), head_dim=128,
                 max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
    windowed, full = configs(a.layout, a.window, shape)
    model = CausalLM.from_config(windowed, seed=0).eval()
    twin = CausalLM(full).eval()
    twin.load_state_dict(model.state_dict())
    engines = {
        f"window {a.window}": TailraceEngine(model, num_slots=8, attention=a.attention),
        "no window": TailraceEngine(twin, num_slots=8, attention=a.attention),
    }
    print(
        f"{a.layout} layout, backend {engines['no window'].backend}, fp32, prompt {a.prompt}, new {a.new}; {shape}"
    )
    for b in map(int, a.batches.split(",")):
        g = torch.Generator().manual_seed(b)
        reqs = [
            GenRequest(
                f"r{i}",
                tuple(torch.randint(1, 4096, (a.prompt,), generator=g).tolist()),
                SamplingParams(max_new_tokens=a.new, temperature=1.0, seed=i),
            )
            for i in range(b)
        ]
        best: dict[str, float] = {}
        outs = {}
        for _ in range(a.repeats):
            for name, eng in engines.items():
                t = time.perf_counter()
                outs[name] = eng.generate(reqs)
                tokens = sum(a.prompt + len(o.token_ids) for o in outs[name])
                best[name] = max(best.get(name, 0.0), tokens / (time.perf_counter() - t))
        same = sum(x.token_ids == y.token_ids for x, y in zip(*outs.values()))
        w, f = best[f"window {a.window}"], best["no window"]
        print(f"B={b}: window {w:8.0f} tok/s   no window {f:8.0f} tok/s   {w / f:.2f}x   "
              f"({same} of {b} samples the same tokens)")  # fmt: skip


if __name__ == "__main__":
    main()
