"""What attending to a sliding window saves the engine's decode: one model with a window (Mistral v0.1's
layout, every layer; or Gemma 3's, five sliding layers of six) against the same weights without one,
side by side in one process, alternated, best of `--repeats`.

    .venv/bin/python bench/window.py                          # Mistral's layout, window 256, ~2 min
    .venv/bin/python bench/window.py --layout gemma3 --attention bmm
    .venv/bin/python bench/window.py --trainer                # the trainer's windowed attention, ~1 min

Random weights (seeded), fp32, one thread; each batch size B sends B requests of `--prompt` tokens and
`--new` new tokens at temperature 1 (seeded), and the same requests for one new token (the prefill). Prints
per model and batch the prefill's tokens/s and the decode's (the new tokens past the first over the time
past the prefill's), best of `--repeats`, and the windowed one's / the windowless one's. The kernel backend reads
only a token's window from the cache (the whole blocks before it skipped); the torch backend gathers every
position and masks those before the window, so it saves nothing there.

`--trainer`: one attention's forward and backward as the trainer runs it (8 rows, 8 heads of 64, 4 kv
heads, fp32, two threads), at 512 / 1,024 / 2,048 tokens with a window of 128: causal SDPA (no window),
SDPA under the window's mask over the whole sequence (what the trainer ran first), and
`windowed_attention` (a window of queries at a time over the keys it can reach), best of 3.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def trainer_attention(window: int = 128) -> None:
    from torch.nn import functional as F

    from tailrace.model.attention import causal_mask, windowed_attention

    torch.manual_seed(0)
    torch.set_num_threads(2)
    for T in (512, 1024, 2048):
        q = torch.randn(8, T, 8, 64, requires_grad=True)
        k, v = torch.randn(8, T, 4, 64, requires_grad=True), torch.randn(8, T, 4, 64, requires_grad=True)

        def sdpa(**kw):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True, **kw
            )

        runs = {
            "causal": lambda: sdpa(is_causal=True),
            "masked": lambda: sdpa(attn_mask=causal_mask(T, torch.bool, q.device, window)),
            "windowed": lambda: windowed_attention(q, k, v, None, window),
        }
        best = {}
        for name, f in runs.items():
            f().sum().backward()
            for _ in range(3):
                t = time.perf_counter()
                f().sum().backward()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
        print(f"T={T}, window {window}: causal {best['causal']:.3f} s, masked {best['masked']:.3f} s, windowed "
              f"{best['windowed']:.3f} s: masked / windowed {best['masked'] / best['windowed']:.2f}x")  # fmt: skip


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
    p.add_argument("--trainer", action="store_true", help="the trainer's windowed attention instead")
    a = p.parse_args()
    if a.trainer:
        return trainer_attention()
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
        first = [dataclasses.replace(r, params=dataclasses.replace(r.params, max_new_tokens=1)) for r in reqs]
        prefill: dict[str, float] = {}
        whole: dict[str, float] = {}
        outs = {}
        for _ in range(a.repeats):
            for name, eng in engines.items():
                t = time.perf_counter()
                eng.generate(first)
                prefill[name] = min(prefill.get(name, float("inf")), time.perf_counter() - t)
                t = time.perf_counter()
                outs[name] = eng.generate(reqs)
                whole[name] = min(whole.get(name, float("inf")), time.perf_counter() - t)
        same = sum(x.token_ids == y.token_ids for x, y in zip(*outs.values()))
        rates = {}
        for name in engines:
            new = sum(len(o.token_ids) - 1 for o in outs[name])
            rates[name] = (b * a.prompt / prefill[name], new / max(whole[name] - prefill[name], 1e-9))
        (wp, wd), (fp, fd) = rates[f"window {a.window}"], rates["no window"]
        print(f"B={b}: prefill {wp:7.0f} vs {fp:7.0f} tok/s ({wp / fp:.2f}x)   decode {wd:6.1f} vs {fd:6.1f} tok/s "
              f"({wd / fd:.2f}x)   window vs none; {same} of {b} samples the same tokens")  # fmt: skip


if __name__ == "__main__":
    main()
