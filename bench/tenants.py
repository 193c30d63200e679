"""Multi-tenant LoRA serving: N tenants' requests mixed in one engine batch vs the same requests tenant by
tenant, on the same engine, one run, one table (#19 item 3, first figure).

    .venv/bin/python bench/tenants.py                 # tenants 1, 4, 8 (writes bench/out/tenants.json)
    .venv/bin/python bench/tenants.py --quick         # smoke run: tenants 1 and 4, fewer requests
    PYTHONPATH=. .venv-vllm/bin/python bench/tenants.py --backend vllm   # the same on vLLM's LoRA (make vllm)

The model is the default tailrace architecture (the warm start's shape: hidden 128, 4 layers, 0.8M
parameters) with seeded random weights; each tenant has its own seeded random LoRA adapter (rank
`--rank`, every projection). Each tenant sends `--per-tenant` requests: 16-token random prompts and a
response of exactly its length, drawn lognormal (median 45, p99/median ~6, capped at 256: the shape of
bench/engine.py's continuous-batching workload), temperature 1, no stop tokens. For N tenants:

- **mixed**: all N x per-tenant requests added to the engine at once; each step's forward serves rows
  of every adapter (base GEMMs once, the low-rank terms per row);
- **one by one**: the same requests, one tenant's after another's on the same engine (each waits for
  its tail before the next tenant starts) — one adapter per batch;
- **no adapter**: the mixed workload with every request on the base model (what the adapters cost).

samples/s = requests / wall seconds, best of `--repeats` runs taken in turn; tokens/s likewise; a second
table divides by the CPU seconds of the thread instead (the comparable figure on a shared machine);
**slot use** = decode rows per step / slots, averaged over steps weighted by their time (the engine's
utilization); with `--backend vllm` the engine is vLLM serving the adapters through its own LoRA support
(punica; on CPU `PunicaWrapperCPU`), the base saved as a checkpoint it loads; **engine steps** per arm,
which do not depend on the machine's load. The 1-minute load
average is printed: the machine may be shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import ArchConfig  # noqa: E402
from tailrace.config.train import LoraConfig  # noqa: E402
from tailrace.engine import TailraceEngine, build_engine  # noqa: E402
from tailrace.engine import adapters as adapters_mod  # noqa: E402
from tailrace.model import lora  # noqa: E402
from tailrace.model.checkpoint import load_pretrained, save_pretrained  # noqa: E402
from tailrace.model.decoder import CausalLM  # noqa: E402
from tailrace.runtime import warmstart  # noqa: E402
from tailrace.tokenizer import char_tokenizer  # noqa: E402
from tailrace.types import GenRequest, SamplingParams  # noqa: E402

PROMPT_TOKENS = 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", default="1,4,8")
    p.add_argument("--per-tenant", type=int, default=16, help="requests per tenant")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--hidden", type=int, default=None, help="model width (default: the built-in's, 128)")
    p.add_argument("--model", help="a local HF checkpoint as the base (e.g. SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--attention", default="auto", help="the engine backend: auto (kernel), kernel, bmm")
    p.add_argument("--backend", default="tailrace", choices=["tailrace", "vllm"], help="the rollout engine")
    p.add_argument("--layers", type=int, default=None, help="model depth (default: the built-in's, 4)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (on CUDA read the wall-clock table)")
    p.add_argument(
        "--lora-terms",
        default="auto",
        choices=["auto", "grouped"],
        help="grouped: the per-slot groups on every device (auto gathers per token on accelerators)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each arm (best of), interleaved")
    p.add_argument("--quick", action="store_true", help="tenants 1,4; 8 requests each; 1 repeat")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "tenants.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.tenants, a.per_tenant, a.repeats = "1,4", 8, 1
    return a


def base_model(hidden: int | None = None, layers: int | None = None) -> CausalLM:
    """The built-in architecture, or that shape at width `hidden` (the MLP 3x as wide, 64-wide heads)
    and depth `layers`."""
    tok = char_tokenizer()
    arch = ArchConfig()
    if hidden:
        arch = ArchConfig(hidden_size=hidden, num_heads=hidden // 64, num_kv_heads=hidden // 128 or 1,
                          intermediate_size=3 * hidden)  # fmt: skip
    if layers:
        arch = dataclasses.replace(arch, num_layers=layers)
    return CausalLM.from_config(warmstart.model_config(arch, tok.vocab_size, tok), seed=0).eval()


def adapter(base: CausalLM, rank: int, seed: int) -> lora.Adapter:
    """A random adapter on every projection, its update about a tenth of the base weights'."""
    torch.manual_seed(seed)
    m = lora.attach(CausalLM.from_config(base.config, seed=0), LoraConfig(rank=rank, alpha=2.0 * rank))
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, lora.LoRALinear):
                mod.lora_B.weight.normal_(0.0, 0.02)
    return lora.adapter_of(m)


def workload(n_tenants: int, per_tenant: int, vocab: int, seed: int = 0) -> list[list[GenRequest]]:
    """Per tenant its requests (tenant t's adapter is named t{t})."""
    rng = random.Random(seed)
    out = []
    for t in range(n_tenants):
        reqs = []
        for i in range(per_tenant):
            n = min(256, max(4, int(rng.lognormvariate(math.log(45), 0.8))))
            ids = tuple(rng.randrange(4, vocab) for _ in range(PROMPT_TOKENS))
            params = SamplingParams(max_new_tokens=n, seed=rng.getrandbits(32))
            reqs.append(GenRequest(f"t{t}-{i}", ids, params, adapter=f"t{t}"))
        out.append(reqs)
    return out


def engine(a: argparse.Namespace, base: CausalLM, n_adapters: int):
    """tailrace's engine over `base`, or vLLM loading it from a scratch checkpoint, serving LoRA adapters."""
    if a.backend == "tailrace":
        return TailraceEngine(
            base, num_slots=a.slots, dtype=a.dtype, attention=a.attention, seed=0, device=a.device
        )
    path = Path(tempfile.mkdtemp(prefix="tenants-base-"))
    save_pretrained(base, path)
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[a.dtype]
    return build_engine(path, backend="vllm", num_slots=a.slots, dtype=dtype, seed=0, threads=a.threads,
                        max_context=PROMPT_TOKENS + 256, kv_memory_gb=0.5, lora_rank=a.rank,
                        max_adapters=n_adapters)  # fmt: skip


def run(eng, batches: list[list[GenRequest]]) -> dict:
    """The batches one after another (each to its last result); wall time, tokens, slot use."""
    t0, c0 = time.perf_counter(), time.thread_time()
    tokens = samples = steps = 0
    busy = weighted = 0.0
    for reqs in batches:
        for r in reqs:
            eng.add(r)
        while eng.num_running or eng.num_waiting:
            ev = eng.step()
            steps += 1
            busy += ev.duration
            weighted += ev.duration * ev.active
            for res in ev.finished:
                tokens += len(res.token_ids)
                samples += 1
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    use = weighted / busy / eng.num_slots
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "samples": samples,
        "tokens": tokens,
        "steps": steps,
        "slot_use": use,
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.lora_terms == "grouped":
        adapters_mod.gathered = lambda device: False
    base = load_pretrained(a.model).eval() if a.model else base_model(a.hidden, a.layers)
    tenants = [int(x) for x in a.tenants.split(",")]
    eng = engine(a, base, max(tenants))
    for t in range(max(tenants)):
        eng.load_adapter(f"t{t}", adapter(base, a.rank, seed=100 + t))
    load = os.getloadavg()[0]
    print(
        f"engine: {eng.describe()}; {base.num_parameters() / 1e6:.1f}M parameters, {a.dtype} on {a.device}, "
        f"{a.threads} thread(s); {max(tenants)} adapters of rank "
        f"{a.rank} loaded; load average {load:.2f}"
    )
    run(eng, workload(2, 8, base.config.vocab_size, seed=99))  # warm-up (kernels built, caches warm)
    rows = []
    for n in tenants:
        per = workload(n, a.per_tenant, base.config.vocab_size, seed=n)
        everyone = [r for reqs in per for r in reqs]
        plain = [GenRequest(r.id, r.prompt_ids, r.params) for r in everyone]
        arms = {"mixed": [everyone], "one by one": per, "no adapter": [plain]}
        best: dict[str, dict] = {}
        for _ in range(a.repeats):  # interleaved: the machine's drift falls on every arm alike
            for name, batches in arms.items():
                r = run(eng, batches)
                if name not in best or r["wall_s"] < best[name]["wall_s"]:
                    best[name] = r
        rows.append({"tenants": n, **{k: v for k, v in best.items()}})
    for clock, what in (("wall_s", "wall"), ("cpu_s", "CPU")):
        print(
            f"\n{a.per_tenant} requests per tenant, {a.slots} slots; samples per {what} second (tokens) [slot use]"
        )
        print("| tenants | mixed | one by one | mixed / one by one | no adapter | mixed / no adapter |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            m, s, p = row["mixed"], row["one by one"], row["no adapter"]

            def cell(r):
                t = r[clock]
                return f"{r['samples'] / t:.1f} ({r['tokens'] / t:,.0f}) [{r['slot_use']:.0%}]"

            print(
                f"| {row['tenants']} | {cell(m)} | {cell(s)} | {s[clock] / m[clock]:.2f}x | {cell(p)} "
                f"| {p[clock] / m[clock]:.2f}x |"
            )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "load_avg_1m": load, "rows": rows}, indent=2) + "\n")
    print("\nengine steps (deterministic: the batching itself, whatever the machine's load)")
    print("| tenants | mixed | one by one | no adapter |")
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['tenants']} | "
            + " | ".join(str(row[k]["steps"]) for k in ("mixed", "one by one", "no adapter"))
            + " |"
        )
    print(f"load average now {os.getloadavg()[0]:.2f}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
