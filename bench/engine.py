"""Engine throughput: tailrace's engine vs Hugging Face `generate` vs vLLM's CPU build, one run, one table.

    .venv/bin/python bench/engine.py                # full run (writes bench/out/engine.json)
    .venv/bin/python bench/engine.py --quick        # smoke run: batches 1 and 8, 32 new tokens

Every contender generates the same shape of work from the same checkpoint: `batch` requests, each a
16-token random prompt and exactly `--new-tokens` sampled tokens (temperature 1.0, no top-k/top-p, EOS
ignored), torch pinned to `--threads` threads. tokens/s = batch * new_tokens / wall seconds of one
whole generate call (prefill included), median of `--repeats` timed calls after one warm-up; the
in-process contenders (tailrace, the same engine on torch ops, HF) take turns call by call, so the
machine's drift over minutes falls on all of them alike.

- "gemm limit": the decode step's matrix multiplies alone (the engine's fused projections and the
  LM head at that batch, in a loop), least CPU time of the repeats: the physical limit of this model
  on this core; "share" = engine tokens per CPU-second / limit.
- vLLM runs through `bench/vllm_runner.py` in `.venv-vllm` (build it with `make vllm`), in its own
  processes, with the same thread count; a probe around its `generate` reads its model worker's CPU time.
- Two tables: wall-clock tokens/s, and tokens per CPU-second of the thread (process, for vLLM's worker)
  that generates. On an idle machine they agree; on a shared one the second is the comparable number
  (CFS gives vLLM's worker, which sleeps on IPC every step, a larger share of a busy CPU).
- The continuous-batching workload sends 512 requests with long-tailed (lognormal) response lengths
  through 64 slots, then the same requests as static batches of 64 that wait for their longest.
The machine may be shared: the 1-minute load average is printed and stored with the results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import ArchConfig  # noqa: E402
from tailrace.engine import TailraceEngine, ckernel  # noqa: E402
from tailrace.engine.backends.weights import FusedWeights  # noqa: E402
from tailrace.model.checkpoint import load_pretrained, save_pretrained  # noqa: E402
from tailrace.model.decoder import CausalLM  # noqa: E402
from tailrace.runtime import warmstart  # noqa: E402
from tailrace.tokenizer import char_tokenizer  # noqa: E402
from tailrace.types import GenRequest, SamplingParams  # noqa: E402

PROMPT_TOKENS = 16  # as bench/vllm_runner.py
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        help="HF checkpoint dir (default: the default architecture, random weights, "
        "seeded, saved to a temp dir)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cb-requests", type=int, default=512)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument(
        "--quick", action="store_true", help="batches 1,8; 32 new tokens; 1 repeat; 128 CB requests"
    )
    p.add_argument("--profile", action="store_true", help="only profile decode steps at each batch/dtype")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "engine.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.batches, a.new_tokens, a.repeats, a.cb_requests = "1,8", 32, 1, 128
    a.batches = [int(x) for x in a.batches.split(",")]
    a.dtypes = a.dtypes.split(",")
    return a


def default_model_dir(tmp: str) -> str:
    """The default tailrace architecture (the warm-start recipe's) with seeded random weights, plus its
    char tokenizer (vLLM needs one)."""
    tok = char_tokenizer()
    cfg = warmstart.model_config(ArchConfig(), tok.vocab_size, tok)
    path = os.path.join(tmp, "model")
    save_pretrained(CausalLM.from_config(cfg, seed=0), path)
    tok.save(path)
    return path


def prompts(batch: int, vocab: int, rng: random.Random) -> list[tuple[int, ...]]:
    return [tuple(rng.randrange(4, vocab) for _ in range(PROMPT_TOKENS)) for _ in range(batch)]


def timed(fn, repeats: int, cpu: list | None = None) -> list[float]:
    """Wall seconds of `repeats` calls after one warm-up; the calling thread's CPU seconds go to `cpu`."""
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        out.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.thread_time() - c0)
    return out


def rates(tokens: int, wall: list[float], cpu: list[float]) -> dict:
    return {
        "tok_s": tokens / statistics.median(wall),
        "best_tok_s": tokens / min(wall),
        "cpu_tok_s": tokens / statistics.median(cpu) if cpu else None,
    }


# -- contenders -------------------------------------------------------------------------------------


def engine_job(engine: TailraceEngine, batch: int, new: int, rng: random.Random):
    """One whole `generate` of `batch` fresh requests per call."""
    V = engine.vocab_size
    params = SamplingParams(temperature=1.0, max_new_tokens=new, min_new_tokens=new)
    n = [0]

    def run():
        reqs = [GenRequest(f"b{n[0]}-{i}", p, params) for i, p in enumerate(prompts(batch, V, rng))]
        n[0] += 1
        engine.generate(reqs)

    return run


def hf_job(model_dir: str, dtype: torch.dtype, batch: int, new: int, rng: random.Random):
    """One Hugging Face `generate` call of `batch` fresh prompts per call (the model loaded once)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    V = hf.config.vocab_size

    def run():
        ids = torch.tensor(prompts(batch, V, rng))
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )

    return run


def measure(jobs: dict, tokens: int, repeats: int) -> dict[str, dict]:
    """The in-process contenders' calls interleaved (one warm-up each, then A B C, A B C, ...): the
    machine's speed drifts over minutes, and interleaving gives every contender the same drift."""
    for fn in jobs.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in jobs}
    cpu: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(repeats):
        for k, fn in jobs.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.thread_time() - c0)
    return {k: rates(tokens, wall[k], cpu[k]) for k in jobs}


# Runs bench/vllm_runner.py unchanged, with LLM.generate wrapped to read the model worker's CPU time
# (through the runner's own collective_rpc channel) around each call: on a shared machine that is the
# comparable number (vLLM's worker and engine-core processes also run in parallel on 2 cores).
_VLLM_CPU_PROBE = """
import json, runpy, sys, time
import vllm
def _cpu(worker):
    import time
    return time.process_time()
_gen = vllm.LLM.generate
def generate(self, *a, **k):
    c0, t0 = self.collective_rpc(_cpu)[0], time.perf_counter()
    out = _gen(self, *a, **k)
    c1, t1 = self.collective_rpc(_cpu)[0], time.perf_counter()
    print("TAILRACE_CPU " + json.dumps({"wall": t1 - t0, "worker_cpu": c1 - c0}), file=sys.stderr, flush=True)
    return out
vllm.LLM.generate = generate
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _reap_group(pgid: int, wait_s: float = 30.0) -> None:
    """Terminate what is left of a finished subprocess's process group and wait until it is gone."""
    import signal

    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    t_end = time.monotonic() + wait_s
    while time.monotonic() < t_end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def bench_vllm(model_dir: str, dtype: str, batch: int, new: int, threads: int, repeats: int) -> dict | str:
    """The runner's tokens/s (median wall) and, from the probe, tokens per CPU-second of its model worker."""
    if not VLLM_PY.exists():
        return "not installed (make vllm)"
    cmd = [
        str(VLLM_PY),
        "-c",
        _VLLM_CPU_PROBE,
        str(ROOT / "bench" / "vllm_runner.py"),
        "--model",
        model_dir,
        "--batch",
        str(batch),
        "--dtype",
        dtype,
        "--new-tokens",
        str(new),
        "--threads",
        str(threads),
        "--repeats",
        str(repeats),
        "--json",
    ]
    try:
        # its own session: vLLM's engine-core process can outlive the runner, and must not share the
        # CPU with the next measurement
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        ) as proc:
            out, err = proc.communicate(timeout=1800)
        _reap_group(proc.pid)
        p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        d = json.loads(p.stdout.strip().splitlines()[-1])
        probes = [
            json.loads(line.split(" ", 1)[1])
            for line in p.stderr.splitlines()
            if line.startswith("TAILRACE_CPU ")
        ][1:]  # the first call is the runner's warm-up
        cpu = [x["worker_cpu"] for x in probes]
        return {
            "tok_s": float(d["tokens_per_s"]),
            "best_tok_s": d.get("tokens_per_s_best"),
            "cpu_tok_s": batch * new / statistics.median(cpu) if cpu else None,
            "runner": d,
        }
    except Exception as e:  # report, never abort the whole bench
        tail = (p.stderr.strip().splitlines() or ["?"])[-1] if "p" in locals() else str(e)
        return f"failed: {tail[:60]}"


def gemm_limit(weights: FusedWeights, batch: int, repeats: int) -> float:
    """tokens/s if a decode step were only its matrix multiplies (fused q/k/v, o, gate/up, down, LM head),
    each by the faster of the engine's GEMM paths (MKL, oneDNN packed; the C kernels' GEMM serves every
    call where the engine runs it), best of the repeats."""
    dt, dev = weights.dtype, weights.device
    x_h = torch.randn(batch, weights.embed.shape[1], dtype=dt, device=dev)
    x_o = torch.randn(batch, weights.H * weights.D, dtype=dt, device=dev)
    x_d = torch.randn(batch, weights.I, dtype=dt, device=dev)
    mats = []
    for L in weights.layers:
        mats += [(x_h, L.qkv), (x_o, L.o), (x_h, L.gate_up), (x_d, L.down)]
    mats.append((x_h, weights.lm_head))
    best = math.inf
    for packed in (False, True) if weights.packed else (False,):

        def steps():
            for _ in range(20):
                for a, lin in mats:
                    lin(a, packed)

        cpu: list[float] = []
        with torch.inference_mode():
            timed(steps, max(repeats, 3), cpu)
        best = min(best, min(cpu) / 20)  # CPU seconds: a bound, so the least disturbed repeat
    return batch / best


# -- profile --------------------------------------------------------------------------------------

# Top-level ops of each kind; their CPU time *with children* counts (bf16 bmm copies its strided
# operands inside the op, and that copy belongs to attention).
_KINDS = (
    ("gemm", ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")),
    ("attention", ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::scaled_dot_product_attention")),
    ("kv write", ("aten::index_copy_",)),
)


def profile_decode(engine: TailraceEngine, batch: int, new: int, rng: random.Random) -> None:
    """torch.profiler over 20 steady-state decode steps: self CPU time by kind of op, then the top ops.
    (The profiler adds a few microseconds per op, so small elementwise ops look costlier than they are.
    The C attention kernel is no aten op: its time is in the step, not in these shares; see ckernel.py.)"""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=1.0, max_new_tokens=new, min_new_tokens=new)
    for i, p in enumerate(prompts(batch, engine.vocab_size, rng)):
        engine.add(GenRequest(f"prof-{batch}-{i}", p, params))
    for _ in range(new // 2):
        engine.step()
    t0 = time.thread_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            engine.step()
    per_step = (time.thread_time() - t0) / 20
    while engine.num_running or engine.num_waiting:
        engine.step()
    events = [e for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::"))]
    total = sum(e.self_cpu_time_total for e in events)
    kinds = {k: sum(e.cpu_time_total for e in events if e.key in names) for k, names in _KINDS}
    kinds["other ops"] = total - sum(kinds.values())
    print(
        f"\n{engine.dtype} batch {batch}: {per_step * 1e3:.2f} ms CPU per step (profiled), CPU by kind: "
        + ", ".join(f"{k} {v / total:.0%}" for k, v in kinds.items())
    )
    print("    top ops by self CPU time (bf16 bmm's operand copies show as aten::copy_):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"    {e.key:42} {e.self_cpu_time_total / total:6.1%}  {e.count // 20:4d} calls/step")


# -- continuous batching ----------------------------------------------------------------------------


def cb_workload(n: int, vocab: int, rng: random.Random) -> list[GenRequest]:
    """Lognormal response lengths (median 48, sigma 0.8: p99/median ~ 6), 16-token prompts."""
    reqs = []
    for i, p in enumerate(prompts(n, vocab, rng)):
        m = int(min(480, max(1, round(math.exp(math.log(48) + 0.8 * rng.gauss(0, 1))))))
        reqs.append(
            GenRequest(f"cb{i}", p, SamplingParams(temperature=1.0, max_new_tokens=m, min_new_tokens=m))
        )
    return reqs


def run_cb(engine: TailraceEngine, reqs: list[GenRequest], static: int | None) -> dict:
    """All requests through the engine; `static`: admit in batches of that size, each waiting for its longest."""
    t0, c0 = time.perf_counter(), time.thread_time()
    busy = 0.0
    total = 0.0
    groups = [reqs] if static is None else [reqs[i : i + static] for i in range(0, len(reqs), static)]
    tokens = 0
    for g in groups:
        for r in g:
            engine.add(r)
        while engine.num_running or engine.num_waiting:
            ev = engine.step()
            busy += ev.active * ev.duration
            total += ev.duration
            tokens += sum(len(r.token_ids) for r in ev.finished)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {
        "tokens_per_s": tokens / wall,
        "cpu_tokens_per_s": tokens / cpu,
        "slot_utilization": busy / (total * engine.num_slots),
        "seconds": wall,
    }


# -- main -------------------------------------------------------------------------------------------


def fmt(x, key: str = "tok_s") -> str:
    if isinstance(x, dict):
        x = x.get(key)
    if x is None:
        return "-"
    return f"{x:,.0f}" if isinstance(x, (int, float)) else str(x)


def ratio(a, b, key: str = "tok_s") -> str:
    a = a.get(key) if isinstance(a, dict) else a
    b = b.get(key) if isinstance(b, dict) else b
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) and b > 0 else "-"


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp(prefix="tailrace-bench-")
    model_dir = a.model or default_model_dir(tmp)
    rng = random.Random(0)
    rows = []
    print(
        f"model {model_dir} | threads {a.threads} | {a.new_tokens} new tokens, {PROMPT_TOKENS}-token prompts | "
        f"load avg {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    for dn in a.dtypes:
        dtype = DTYPES[dn]
        model = load_pretrained(model_dir, dtype=dtype)
        engine = TailraceEngine(
            model, num_slots=max(64, *a.batches), max_context=PROMPT_TOKENS + a.new_tokens + 16, seed=0
        )
        # the engine's fused GEMMs (its C GEMM where it runs one), for the limit
        weights = FusedWeights(model, kernel=ckernel.load() if engine.backend == "kernel" else None)
        # the same engine on torch ops (batched-GEMM attention, torch RoPE/cache writes/RMSNorm/SiLU), which
        # the C kernels replaced where they are in use
        bmm = (
            None
            if engine.backend != "kernel"
            else TailraceEngine(
                model,
                num_slots=max(64, *a.batches),
                max_context=PROMPT_TOKENS + a.new_tokens + 16,
                seed=0,
                attention="bmm",
            )
        )
        if a.profile:
            for b in a.batches:
                profile_decode(engine, b, a.new_tokens, rng)
            continue
        for b in a.batches:
            row = {"dtype": dn, "batch": b}
            jobs = {"tailrace": engine_job(engine, b, a.new_tokens, rng)}
            if bmm is not None:
                jobs["bmm"] = engine_job(bmm, b, a.new_tokens, rng)
            if not a.no_hf:
                jobs["hf"] = hf_job(model_dir, dtype, b, a.new_tokens, rng)
            row.update(measure(jobs, b * a.new_tokens, a.repeats))
            row.setdefault("bmm", "no kernel")
            row.setdefault("hf", "skipped")
            row["vs_bmm"] = ratio(row["tailrace"], row["bmm"])
            row["gemm_limit"] = gemm_limit(weights, b, a.repeats)
            row["share"] = row["tailrace"]["cpu_tok_s"] / row["gemm_limit"]
            row["vllm"] = (
                "skipped" if a.no_vllm else bench_vllm(model_dir, dn, b, a.new_tokens, a.threads, a.repeats)
            )
            row["vs_hf"], row["vs_vllm"] = (
                ratio(row["tailrace"], row["hf"]),
                ratio(row["tailrace"], row["vllm"]),
            )
            row["cpu_vs_hf"] = ratio(row["tailrace"], row["hf"], "cpu_tok_s")
            row["cpu_vs_vllm"] = ratio(row["tailrace"], row["vllm"], "cpu_tok_s")
            rows.append(row)
            print(
                f"  {dn} batch {b}: tailrace {fmt(row['tailrace'])} tok/s (torch ops {fmt(row['bmm'])}), "
                f"hf {fmt(row['hf'])}, "
                f"vllm {fmt(row['vllm'])}, gemm limit {fmt(row['gemm_limit'])} | per CPU-s: tailrace "
                f"{fmt(row['tailrace'], 'cpu_tok_s')}, hf {fmt(row['hf'], 'cpu_tok_s')}, "
                f"vllm {fmt(row['vllm'], 'cpu_tok_s')} | load avg {os.getloadavg()[0]:.2f}",
                flush=True,
            )

    if a.profile:
        return 0
    cb = run_cb_workload(model_dir, a.dtypes[0], a.cb_requests) if a.cb_requests else None

    header = (
        f"{'dtype':5} {'batch':>5} {'tailrace':>10} {'HF':>10} {'vLLM':>26} {'gemm limit':>11} {'share':>6} "
        f"{'/HF':>6} {'/vLLM':>6}"
    )
    print("\ntokens/s (higher is better)\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['dtype']:5} {r['batch']:>5} {fmt(r['tailrace']):>10} {fmt(r['hf']):>10} {fmt(r['vllm']):>26} "
            f"{fmt(r['gemm_limit']):>11} {r['share']:>6.0%} {r['vs_hf']:>6} {r['vs_vllm']:>6}"
        )
    print(
        "\nthe C kernels (RoPE + cache writes + attention per layer, RMSNorm, SiLU-mul) vs the same engine on "
        "torch ops (batched-GEMM attention)\n"
        f"{'dtype':5} {'batch':>5} {'kernels':>10} {'torch':>10} {'ratio':>6}"
    )
    for r in rows:
        print(f"{r['dtype']:5} {r['batch']:>5} {fmt(r['tailrace']):>10} {fmt(r['bmm']):>10} {r['vs_bmm']:>6}")
    print(
        "\nper CPU-second of the generating thread (the machine may be shared; vLLM: its worker process, "
        "when the runner reports worker_cpu_s)\n" + f"{'dtype':5} {'batch':>5} {'tailrace':>10} {'HF':>10} "
        f"{'vLLM':>10} {'/HF':>6} {'/vLLM':>6}"
    )
    for r in rows:
        print(
            f"{r['dtype']:5} {r['batch']:>5} {fmt(r['tailrace'], 'cpu_tok_s'):>10} {fmt(r['hf'], 'cpu_tok_s'):>10} "
            f"{fmt(r['vllm'], 'cpu_tok_s'):>10} {r['cpu_vs_hf']:>6} {r['cpu_vs_vllm']:>6}"
        )
    if cb is not None:
        print_cb(cb)
    out = {
        "args": {k: v for k, v in vars(a).items()},
        "model": model_dir,
        "torch": torch.__version__,
        "loadavg_1m_end": os.getloadavg()[0],
        "rows": rows,
        "continuous_batching": cb,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {a.out} | load avg {os.getloadavg()[0]:.2f}")
    return 0


def run_cb_workload(model_dir: str, dn: str, n: int) -> dict:
    """The continuous-batching workload (`cb_workload`), continuous and as static batches of 64."""
    engine = TailraceEngine(
        load_pretrained(model_dir, dtype=DTYPES[dn]), num_slots=64, max_context=PROMPT_TOKENS + 512, seed=0
    )
    reqs = cb_workload(n, engine.vocab_size, random.Random(1))
    lens = sorted(r.params.max_new_tokens for r in reqs)
    run_cb(engine, reqs[:64], None)  # warm-up
    return {
        "dtype": dn,
        "requests": len(reqs),
        "slots": 64,
        "median_len": lens[len(lens) // 2],
        "p99_len": lens[int(0.99 * (len(lens) - 1))],
        "continuous": run_cb(engine, reqs, None),
        "static": run_cb(engine, reqs, 64),
    }


def print_cb(cb: dict) -> None:
    c, s, dn = cb["continuous"], cb["static"], cb["dtype"]
    print(
        f"\ncontinuous batching, {dn}: {cb['requests']} requests, lognormal lengths (median {cb['median_len']}, "
        f"p99 {cb['p99_len']}, p99/median {cb['p99_len'] / cb['median_len']:.1f}) through {cb['slots']} slots"
    )
    for name, r in (("continuous", c), ("static", s)):
        print(
            f"  {name:10}  {fmt(r['tokens_per_s']):>8} tok/s ({fmt(r['cpu_tokens_per_s'])} per CPU-s)  "
            f"slot utilization {r['slot_utilization']:.0%}"
        )
    print(
        f"  continuous / static: {c['tokens_per_s'] / s['tokens_per_s']:.2f}x wall, "
        f"{c['cpu_tokens_per_s'] / s['cpu_tokens_per_s']:.2f}x per CPU-s"
    )


if __name__ == "__main__":
    sys.exit(main())
