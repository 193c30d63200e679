"""The engine-vs-trainer logprob gap: vLLM and tailrace's own engine, side by side, on one model.

Run it with the interpreter of the venv `make vllm` builds (vLLM's CPU build), tailrace on the path:

    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_gap.py --model DIR --dtype bf16 \
        --requests 16 --new-tokens 64

Both engines get the same prompts (random ids, 16 tokens) with the same per-request seeds, at the
same temperature / top-p, and sample their own responses; each sampled token's behaviour logprob (what
the engine reports) is compared with the trainer's recomputation on those same tokens: one
full-sequence forward of the fp32 model (the trainer's master weights, no autocast) and
`trainer.logprobs.token_logprobs` at the rollout temperature, as the GRPO step computes it. Printed per
engine: mean |delta| and max |delta| over every generated token, and the share of tokens over 1e-2.
Decoding the same tokens is not possible without teacher-forcing each engine's decode path, so the two
rows measure the same model, prompts and seeds, and each engine's own samples; at --temperature 0 the
samples agree (and `same tokens` says how many do). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from tailrace.engine import build_engine
from tailrace.model.checkpoint import load_pretrained, read_config
from tailrace.trainer.logprobs import token_logprobs
from tailrace.types import GenRequest, GenResult, SamplingParams

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
PROMPT_TOKENS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="both engines' weights")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (both engines, the trainer pass)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.requests < 1 or a.new_tokens < 1:
        p.error("--requests and --new-tokens must be >= 1")
    if a.top_p < 1 and a.temperature == 0:
        p.error("--top-p needs --temperature > 0")
    return a


def make_requests(a: argparse.Namespace, vocab: int) -> list[GenRequest]:
    rng = random.Random(a.seed)
    reqs = []
    for i in range(a.requests):
        ids = tuple(rng.randrange(4, vocab) for _ in range(PROMPT_TOKENS))
        params = SamplingParams(
            temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.new_tokens, seed=a.seed * 1000 + i
        )
        reqs.append(GenRequest(f"r{i}", ids, params))
    return reqs


@torch.no_grad()
def trainer_logprobs(model, req: GenRequest, res: GenResult, temperature: float) -> torch.Tensor:
    """(n,) the trainer's logprob of each response token: a full forward of prompt + response."""
    ids = torch.tensor([req.prompt_ids + res.token_ids])
    logits = model(ids)[:, len(req.prompt_ids) - 1 : -1]  # (1, n, V)
    return token_logprobs(logits, torch.tensor([res.token_ids]), temperature or 1.0)[0]


def gap(model, reqs, results, temperature: float) -> dict:
    deltas = torch.cat(
        [
            (
                torch.tensor(res.logprobs, dtype=torch.float64)
                - trainer_logprobs(model, req, res, temperature)
            ).abs()
            for req, res in zip(reqs, results)
        ]
    )
    return {
        "tokens": deltas.numel(),
        "mean_abs": deltas.mean().item(),
        "max_abs": deltas.max().item(),
        "over_1e-2": (deltas > 1e-2).double().mean().item(),
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = read_config(a.model)
    reqs = make_requests(a, cfg.vocab_size)
    context = PROMPT_TOKENS + a.new_tokens + 16
    runs: dict[str, list[GenResult]] = {}
    seconds: dict[str, float] = {}

    vllm = build_engine(a.model, backend="vllm", num_slots=a.requests, max_context=context,
                        dtype=DTYPES[a.dtype], seed=a.seed, threads=a.threads)  # fmt: skip
    own = build_engine(load_pretrained(a.model, dtype=getattr(torch, DTYPES[a.dtype])), num_slots=a.requests,
                       max_context=context, seed=a.seed, threads=a.threads)  # fmt: skip
    for name, eng in (("vllm", vllm), ("tailrace", own)):
        eng.generate(reqs[:1])  # warm-up
        t0 = time.perf_counter()
        runs[name] = eng.generate(reqs)
        seconds[name] = time.perf_counter() - t0
    trainer = load_pretrained(a.model, dtype=torch.float32).eval()
    rows = {name: gap(trainer, reqs, res, a.temperature) for name, res in runs.items()}
    same = sum(x.token_ids == y.token_ids for x, y in zip(runs["vllm"], runs["tailrace"]))
    print(
        f"{os.path.basename(a.model.rstrip('/'))}, {a.dtype} engines vs fp32 trainer; T={a.temperature}, "
        f"top_p={a.top_p}; {a.requests} x {a.new_tokens} tokens; same tokens in {same}/{a.requests} requests",
        file=sys.stderr,
    )
    print(
        f"{'engine':<10}{'tokens':>8}{'mean |d|':>12}{'max |d|':>12}{'>1e-2':>8}{'gen s':>8}", file=sys.stderr
    )
    for name, r in rows.items():
        print(
            f"{name:<10}{r['tokens']:>8}{r['mean_abs']:>12.2e}{r['max_abs']:>12.2e}"
            f"{r['over_1e-2']:>8.1%}{seconds[name]:>8.2f}",
            file=sys.stderr,
        )
    out = {
        "model": a.model, "dtype": a.dtype, "temperature": a.temperature, "top_p": a.top_p,
        "requests": a.requests, "new_tokens": a.new_tokens, "same_token_requests": same,
        "gap": rows, "gen_seconds": seconds, "loadavg_1m": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
