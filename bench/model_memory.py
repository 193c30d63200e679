"""What a user's model costs in memory beyond its weights: one engine version, and the trainer's
activations a token (the slope `trainer/memory.py` is fitted to).

    .venv/bin/python bench/model_memory.py engine DIR              # RSS: the model, then with the engine
    .venv/bin/python bench/model_memory.py ring DIR                # the weights ring, fp32 and bf16
    .venv/bin/python bench/model_memory.py trainer qwen3 --bf16    # KiB a token of activations, one shape
    .venv/bin/python bench/model_memory.py trainer llama --layers 16 --recompute  # gradient checkpointing

`engine`: loads the checkpoint (fp32 by default, as the engines do) in this process and builds a
`TailraceEngine` (8 slots, 256 positions: its KV pool is small) on it; prints the resident memory
after each. `--layout gpu`: instead of the engine, the backend a GPU runs (torch, no packed copies),
so what a version holds on a GPU is measured here. `trainer`: a 4-layer model of Qwen3-0.6B's
attention (hidden 512, 8 heads of 128, 4 kv heads, MLP 1536, vocab 4,096), as `llama` or `qwen3`,
takes two `GRPOTrainer.step`s of 64 rows of 8 + 64 tokens with micro-batches of ~1,000 tokens and,
in a fresh process, of ~4,000; the slope of the peak resident memory between the two is the
activations' cost a token, and the second step's seconds at ~4,000 are printed. `--layers N`: N layers
instead of 4; `--recompute`: with train.gradient_checkpointing, and the same without it beside. One thread.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.kv_memory import rss_gib  # noqa: E402
from tailrace.config import TrainerConfig  # noqa: E402
from tailrace.engine import TailraceEngine  # noqa: E402
from tailrace.engine.backends import select  # noqa: E402
from tailrace.model import CausalLM, ModelConfig  # noqa: E402
from tailrace.model.checkpoint import load_pretrained, read_config  # noqa: E402
from tailrace.model.flat import flatten_parameters  # noqa: E402
from tailrace.runtime.weights import SharedWeights  # noqa: E402
from tailrace.trainer.grpo import GRPOTrainer  # noqa: E402
from tailrace.trainer.memory import activation_bytes_per_token  # noqa: E402
from tailrace.types import Finish, GenResult, Group, Trajectory  # noqa: E402

MICRO = (1024, 4096)  # micro-batch token caps: 14 and 56 rows of 72 tokens


def engine(path: str, dtype: str, layout: str) -> None:
    model = load_pretrained(path, dtype=getattr(torch, dtype))
    for p in model.parameters():  # in private memory, as the weights an engine loads: a checkpoint
        p.data = p.data.clone()  # in its own dtype is mapped, and its pages count only once read
    model.tie_weights()
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    a = rss_gib()
    if layout == "cpu":
        eng = TailraceEngine(model, num_slots=8, seed=0, max_context=256)  # held while measured
        name = eng.backend
    else:  # what a version holds on a GPU: the torch backend's weights, no packed copies
        eng = select("sdpa", model, 256, getattr(torch, dtype))(model, packed=False)
        name = "sdpa, unpacked (a GPU's layout)"
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # what the process holds, not what glibc keeps of what it freed
    b = rss_gib()
    print(f"{dtype}: the model {a:.2f} GiB, with one engine version {b:.2f} GiB (+{b - a:.2f}; {name})")


def ring(path: str, slots: int) -> None:
    """The published-weights ring of a full fine-tune of `path`, `slots` versions written into it (the
    trainer's fp32 buffer), in fp32 and in bf16 (`model.dtype=bfloat16`): the shared memory it holds."""

    def shmem_gib() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssShmem")) / 2**20

    with torch.device("meta"):
        layout = flatten_parameters(CausalLM(read_config(path)))
    n = layout.buffer.numel()
    published = torch.randn(n)
    for dtype in (torch.float32, torch.bfloat16):
        before = shmem_gib()
        weights = SharedWeights(layout.layout, n, dtype, slots)
        for v in range(slots):
            weights.write(v, published)
        print(
            f"{dtype}: {n / 1e6:.0f}M parameters, {slots} versions: {shmem_gib() - before:.2f} GiB of shared memory"
        )
        del weights


def model_config(model_type: str, layers: int = 4) -> ModelConfig:
    """Qwen3-0.6B's attention in 4 layers, as `model_type` (Gemma 2's with its caps at Gemma-2's values;
    no window: the rows' 72 tokens would fit any real one)."""
    gemma = {
        "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        # Qwen3-30B-A3B's proportions: 16 experts of a quarter of the MLP's width, 4 a token
        "qwen3_moe": dict(
            num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384, norm_topk_prob=True
        ),
        # Qwen1.5-MoE-A2.7B's: 4 experts a token, each a quarter of the shared expert's width, which is the MLP's
        "qwen2_moe": dict(
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=384,
            shared_expert_intermediate_size=1536,
        ),
    }.get(model_type, {})
    return ModelConfig(model_type=model_type, vocab_size=4096, hidden_size=512, intermediate_size=1536,
                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                       max_position_embeddings=512, tie_word_embeddings=True, **gemma)  # fmt: skip


def shape(model_type: str, layers: int, path: str | None) -> ModelConfig:
    """The shape measured: `model_config`'s, or the checkpoint's at `path` (its config alone: random weights)."""
    return read_config(path) if path else model_config(model_type, layers)


def peak_kib(
    model_type: str, bf16: bool, micro: int, layers: int, recompute: bool, path: str | None = None
) -> tuple[int, int, float]:
    """(micro-batch tokens, peak RSS KiB, seconds) of a second trainer step (the first allocates AdamW's
    moments)."""
    cfg = shape(model_type, layers, path)
    vocab = min(cfg.vocab_size, 4096)
    tc = TrainerConfig(micro_batch_tokens=micro, bf16=bf16, gradient_checkpointing=recompute)
    trainer = GRPOTrainer(CausalLM.from_config(cfg, seed=0), tc)
    rng = random.Random(0)
    groups = []
    for g in range(8):
        trajs = []
        for i in range(8):
            resp = tuple(rng.randrange(1, vocab) for _ in range(64))
            res = GenResult(f"{g}-{i}", resp, (-1.0,) * 64, (0,) * 64, Finish.STOP)
            prompt = tuple(rng.randrange(1, vocab) for _ in range(8))
            trajs.append(Trajectory(group=g, sample_index=i, prompt_id=g, prompt_ids=prompt, result=res,
                                    reward=float(i % 2), correct=bool(i % 2)))  # fmt: skip
        groups.append(Group(id=g, prompt_id=g, trajectories=tuple(trajs)))
    trainer.step(groups, 0)
    t0 = time.perf_counter()
    trainer.step(groups, 0)
    return (micro // 72) * 72, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    e = sub.add_parser("engine")
    e.add_argument("path")
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    e.add_argument("--layout", default="cpu", choices=("cpu", "gpu"), help="gpu: the torch backend unpacked")
    r = sub.add_parser("ring")
    r.add_argument("path")
    r.add_argument("--slots", type=int, default=4, help="flow.max_staleness + 3 (the default's: 4)")
    t = sub.add_parser("trainer")
    t.add_argument(
        "model_type", choices=("llama", "qwen3", "olmo2", "gemma3_text", "gemma2", "qwen3_moe", "qwen2_moe")
    )
    t.add_argument("--bf16", action="store_true")
    t.add_argument("--micro", type=int, help="one micro-batch cap, in this process (the others run it)")
    t.add_argument("--layers", type=int, default=4, help="decoder layers of the shape")
    t.add_argument("--model", help="a checkpoint directory whose shape to measure instead (random weights)")
    t.add_argument("--recompute", action="store_true", help="gradient checkpointing, and without it beside")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.what == "ring":
        ring(a.path, a.slots)
    elif a.what == "engine":
        engine(a.path, a.dtype, a.layout)
    elif a.micro:
        print(*peak_kib(a.model_type, a.bf16, a.micro, a.layers, a.recompute, a.model))
    else:
        for recompute in (False, True) if a.recompute else (False,):
            flags = ["--bf16"] * a.bf16 + ["--recompute"] * recompute + [f"--layers={a.layers}"]
            flags += [f"--model={a.model}"] if a.model else []
            runs = [
                subprocess.run([sys.executable, __file__, "trainer", a.model_type, *flags, f"--micro={m}"],
                               capture_output=True, text=True, check=True).stdout.split()
                for m in MICRO
            ]  # fmt: skip
            (t0, k0, _), (t1, k1, s1) = ([float(x) for x in r] for r in runs)
            cfg = shape(a.model_type, a.layers, a.model)
            est = activation_bytes_per_token(cfg, a.bf16, cpu=True, recompute=recompute) / 1024
            name = a.model or f"{a.model_type} x{a.layers}"
            print(f"{name} {'bf16' if a.bf16 else 'fp32'}"
                  f"{', gradient checkpointing' * recompute}: peaks {k0:,.0f} and {k1:,.0f} KiB at {t0:,.0f} and "
                  f"{t1:,.0f} tokens a micro-batch: {(k1 - k0) / (t1 - t0):.0f} KiB a token "
                  f"(trainer/memory.py estimates {est:.0f}); the step at {t1:,.0f}: {s1:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
