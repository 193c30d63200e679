"""bench/turns.py: multi-turn episodes on one engine, a finished turn's k/v kept for its continuation
(`keep_finished`, what `rollout.keep_kv` turns on for tool tasks) against freed and prefilled again.

    .venv/bin/python bench/turns.py [--model DIR] [--dtype bfloat16] [--episodes 64] [--turns 4]

Each episode is a seeded request whose turns end at a token budget (a tool call, as far as the engine
can tell); after each turn its continuation -- the whole context so far plus an observation of
--obs tokens, under the episode's seed, as the scheduler sends it (flow/turns.py) -- joins the batch
at once (an instant tool). Up to --slots episodes run at a time. The two engines take turns, --repeats
times; printed: generated tokens per second of wall and of CPU, prompt + resumed tokens prefilled,
tokens the kept k/v spared, and whether the tokens are the same both ways (they must be, to within
batch-shape float differences: the kept k/v are those uninterrupted decoding computes).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tailrace.config import ArchConfig, SFTConfig  # noqa: E402
from tailrace.engine import TailraceEngine  # noqa: E402
from tailrace.flow.turns import continuation  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.runtime.warmstart import ensure_warm_start  # noqa: E402
from tailrace.types import GenRequest, SamplingParams  # noqa: E402


def episodes(n: int, turns: int, vocab: int, seed: int = 0) -> list[tuple[GenRequest, list[int]]]:
    """(first request, each turn's token budget): prompts of 24-64 tokens, turns of 8-40."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(24, 64)))
        budgets = [rng.randint(8, 40) for _ in range(turns)]
        out.append((GenRequest(f"e{i}", ids, SamplingParams(max_new_tokens=budgets[0], seed=i)), budgets))
    return out


def run(engine: TailraceEngine, work, obs: int) -> tuple[float, float, int, int, dict]:
    """Every episode to its last turn; (wall s, CPU s, generated tokens, prefilled tokens, tokens)."""
    plan = {r.id: (r, b) for r, b in work}
    total = {r.id: b[0] for r, b in work}  # an episode's response budget so far
    turn = {r.id: 0 for r, _ in work}
    for r, _ in work:
        engine.add(r)
    out, prefilled = {}, 0
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.num_running or engine.num_waiting:
        ev = engine.step()
        prefilled += ev.prefill_tokens
        for res in ev.finished:
            ep = res.request_id.split(".")[0]
            first, budgets = plan[ep]
            turn[ep] += 1
            if turn[ep] == len(budgets):
                out[ep] = res.token_ids
                continue
            observation = tuple((7 * turn[ep] + j) % 50 + 3 for j in range(obs))
            total[ep] += obs + budgets[turn[ep]]
            params = SamplingParams(max_new_tokens=total[ep], seed=first.params.seed)
            engine.add(continuation(f"{ep}.{turn[ep]}", first.prompt_ids, params, 0, res, observation))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    generated = sum(len(t) for t in out.values()) - obs * sum(len(b) - 1 for _, b in work)
    return wall, cpu, generated, prefilled, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--obs", type=int, default=6, help="observation tokens per tool call")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype)
    path = a.model or ensure_warm_start(ArchConfig(), SFTConfig())
    model = load_pretrained(path, dtype=dtype)
    work = episodes(a.episodes, a.turns, model.config.vocab_size)
    rows: dict[bool, list] = {False: [], True: []}
    tokens: dict[bool, dict] = {}
    reused: dict[bool, int] = {}
    for _ in range(a.repeats):
        for keep in (False, True):
            eng = TailraceEngine(model, num_slots=a.slots, max_context=512, keep_finished=keep)
            wall, cpu, gen, pre, out = run(eng, work, a.obs)
            rows[keep].append((wall, cpu, gen, pre))
            tokens[keep], reused[keep] = out, eng.reused_tokens
    print(
        f"{a.episodes} episodes x {a.turns} turns, {a.slots} slots, {path}, {a.dtype}; medians of {a.repeats}"
    )
    print(
        f"{'k/v of a finished turn':>24s} {'tok/s wall':>10s} {'tok/s CPU':>10s} {'prefilled':>10s} {'spared':>8s}"
    )
    med = {}
    for keep in (False, True):
        wall = statistics.median(r[0] for r in rows[keep])
        cpu = statistics.median(r[1] for r in rows[keep])
        gen, pre = rows[keep][0][2], rows[keep][0][3]
        med[keep] = (gen / wall, gen / cpu)
        name = "kept" if keep else "freed, prefilled again"
        print(f"{name:>24s} {gen / wall:10.0f} {gen / cpu:10.0f} {pre:10d} {reused[keep]:8d}")
    same = sum(tokens[True][e] == tokens[False][e] for e in tokens[False])
    print(f"kept / freed: {med[True][0] / med[False][0]:.2f}x wall, {med[True][1] / med[False][1]:.2f}x CPU; "
          f"episodes with the same tokens both ways: {same}/{len(tokens[False])}")  # fmt: skip


if __name__ == "__main__":
    main()
