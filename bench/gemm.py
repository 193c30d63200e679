"""The engine's bf16 GEMMs: the C kernels' own (`ckernel.Kernels.gemm`) against oneDNN's packed linear
(what torch's inductor runs on CPU, and what the engine ran before), side by side in one run.

    .venv/bin/python bench/gemm.py                       # SmolLM2-135M's shapes, rows 1..512
    .venv/bin/python bench/gemm.py --model DIR --rows 32,64

Each shape of a decode step (fused q/k/v, o, gate/up, down, LM head) at each row count, one thread:
- "streamed": distinct copies of the weight (~200 MB of them) called in turn, so each call reads its
  weight from memory, as a decode step reads every layer's weights once (the case that matters);
- "hot": one weight called again and again (cache-resident; the GEMM's arithmetic speed).
GFLOP/s = 2 M N K / thread CPU seconds, the better of two rounds per contender (they take turns).
Every result is checked against an fp32 product first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.engine import ckernel  # noqa: E402
from tailrace.engine.backends.linear import Linear, packing_supported  # noqa: E402

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152}  # fmt: skip


def shapes(cfg: dict) -> list[tuple[str, int, int]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * i, h), ("down", h, i), ("lm_head", v, h)]


def per_call(fn, calls: int, rounds: int = 3) -> float:
    fn(0)
    best = float("inf")
    for _ in range(rounds):
        t = time.thread_time()
        for j in range(calls):
            fn(j)
        best = min(best, (time.thread_time() - t) / calls)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", help="HF checkpoint dir whose config.json gives the shapes (default SmolLM2-135M)"
    )
    p.add_argument("--rows", default="1,8,32,64,512")
    p.add_argument("--mb", type=float, default=200.0, help="MB of weight copies in the streamed case")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "gemm.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    k = ckernel.load()
    if k is None or torch.bfloat16 not in k.gemm_dtypes or not packing_supported(torch.bfloat16):
        print(
            f"needs the C kernels' GEMM (AVX-512 BF16) and oneDNN bf16: {ckernel.unavailable() or 'missing'}"
        )
        return 1
    cfg = json.loads((Path(a.model) / "config.json").read_text()) if a.model else SMOLLM2
    rows = [int(x) for x in a.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    results = []
    print(f"{'shape':>8} {'N x K':>12} {'rows':>5} | {'streamed GFLOP/s':^24} | {'hot GFLOP/s':^24}")
    print(
        f"{'':>8} {'':>12} {'':>5} | {'oneDNN':>7} {'C':>7} {'C/oneDNN':>8} | {'oneDNN':>7} {'C':>7} {'C/oneDNN':>8}"
    )
    for name, N, K in shapes(cfg):
        copies = max(2, int(a.mb * 1e6 // (N * K * 2)))
        ws = [torch.randn(N, K, generator=g).bfloat16() for _ in range(copies)]
        dnn = [Linear(w, None, packed=True) for w in ws]
        mine = [Linear(w, None, packed=True, kernel=k) for w in ws]
        for m in rows:
            x = torch.randn(m, K, generator=g).bfloat16()
            want = F.linear(x.float(), ws[0].float())
            for lins in (dnn, mine):
                torch.testing.assert_close(lins[0](x, True).float(), want, atol=0.5, rtol=1 / 64)
            r = {}
            for _ in range(2):  # contenders take turns
                for tag, lins in (("onednn", dnn), ("c", mine)):
                    s = per_call(lambda j, lins=lins: lins[j % copies](x, True), copies)
                    h = per_call(lambda j, lins=lins: lins[0](x, True), 20)
                    r[tag] = min(r.get(tag, s), s)
                    r[tag + "_hot"] = min(r.get(tag + "_hot", h), h)
            gf = {t: 2 * m * N * K / s / 1e9 for t, s in r.items()}
            results.append(
                {"shape": name, "N": N, "K": K, "rows": m, **{f"{t}_gflops": v for t, v in gf.items()}}
            )
            print(
                f"{name:>8} {f'{N}x{K}':>12} {m:>5} | {gf['onednn']:>7.0f} {gf['c']:>7.0f} "
                f"{gf['c'] / gf['onednn']:>7.2f}x | {gf['onednn_hot']:>7.0f} {gf['c_hot']:>7.0f} "
                f"{gf['c_hot'] / gf['onednn_hot']:>7.2f}x",
                flush=True,
            )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
