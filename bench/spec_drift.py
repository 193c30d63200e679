"""The trained drafter (TLT) over a run of policy versions: frozen after the first round vs refreshed in
every idle period, acceptance per version side by side, against no speculation.

    .venv/bin/python bench/spec_drift.py --versions 7             # 16 prompts x 8 samples, 1-layer drafter
    .venv/bin/python bench/spec_drift.py --versions 7 --layers 2 --lr 5e-3 --sft-steps 40

The policy starts as the warm-started chainsum model (`ensure_warm_start`, cached) and moves between
rounds by rejection-sampling fine-tuning (an RL step: `--sft-steps` AdamW steps at `--lr` on each
prompt's correct responses no longer than their median -- RL's pressure against wordiness that earns
nothing, which on this task reshapes the responses within minutes, DESIGN.md section 6), so each
version is what the previous one's own rollouts made it; each new version is loaded into every engine
as a new version id (the old one dropped), as a run's weight sync does. A round: `--prompts` chainsum
training prompts x `--samples` samples (temperature 1, EOS stops, up to `--max-new` tokens) through
`--slots` slots, so the batch drains from full to a long tail; the same prompts every round (a finite
training set), new seeds.

Three engines live through the whole run: off (no speculation), frozen and refreshed (drafter
`trained`, or `trained2` with `--layers 2`; toggle off, so every decode row drafts the ladder's length
and acceptance is measured at every batch). After each round the refreshed engine's idle time is
given to it (`Engine.idle` in slices: `--first-train-s` seconds after the first round, `--train-s`
after the others -- the engines idle while the policy trains); the frozen engine gets the first
period only -- its drafter trains once, on version 0's rollouts, as long as the refreshed one, then
keeps its layers (it still reads each version's embeddings and head). Outputs are checked identical
to the engine without speculation, token for token.

Per version: the policy's accuracy and mean response length; per drafter, acceptance (per draft token
judged) and mean accepted drafts per verify; in the tail (decode steps with at most `--tail` active
rows) forward passes per generated token (rows in a target forward / tokens they emitted: 1.0 without
speculation) and the speed-up in seconds per token vs off, wall and thread CPU (which load from other
processes barely moves); the whole round's CPU-seconds ratio; the refreshed drafter's training in the
idle period before the round (steps, ms per step, last loss) and the policy update's seconds (the
idle time a sync run gives the engines).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import ArchConfig, SFTConfig  # noqa: E402
from tailrace.engine import TailraceEngine  # noqa: E402
from tailrace.engine.spec import SpecOptions  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.runtime.warmstart import ensure_warm_start  # noqa: E402
from tailrace.tasks.chainsum import ChainSumTask  # noqa: E402
from tailrace.tokenizer import char_tokenizer  # noqa: E402
from tailrace.types import GenRequest, SamplingParams  # noqa: E402

SLICE_S = 0.05  # idle time given per call, as the engine worker does


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", type=int, default=6)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-new", type=int, default=384)
    p.add_argument("--tail", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--first-train-s", type=float, default=20.0, help="both drafters' first idle period")
    p.add_argument("--train-s", type=float, default=8.0, help="the refreshed drafter's later idle periods")
    p.add_argument("--layers", type=int, default=1, choices=(1, 2))
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "spec_drift.json"))
    return p.parse_args(argv)


def rollout(eng, reqs: list[GenRequest], tail: int) -> tuple[dict, list]:
    """One round on a live engine: its figures (see the module doc) and its results in order."""
    st = eng.spec_stats
    base = st and (st.accepted, st.compared, st.verifies)
    for r in reqs:
        eng.add(r)
    steps, results = [], {}  # (active, tokens, wall, cpu) of decode-only steps
    t0, c0 = time.perf_counter(), time.thread_time()
    while len(results) < len(reqs):
        w, c = time.perf_counter(), time.thread_time()
        ev = eng.step()
        if ev.active and not ev.prefill_tokens:
            steps.append((ev.active, ev.decode_tokens, time.perf_counter() - w, time.thread_time() - c))
        for res in ev.finished:
            results[res.request_id] = res
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    tokens = sum(len(r.token_ids) for r in results.values())
    t = [x for x in steps if x[0] <= tail]
    rows, emitted = sum(x[0] for x in t), max(1, sum(x[1] for x in t))
    out = {
        "wall": wall,
        "cpu": cpu,
        "tokens": tokens,
        "mean_len": tokens / len(reqs),
        "tail_fpt": rows / emitted,  # target forward rows per generated token (1.0 without speculation)
        "tail_wall": sum(x[2] for x in t) / emitted,  # seconds per token in the tail
        "tail_cpu": sum(x[3] for x in t) / emitted,
    }
    if base:
        a, c, v = st.accepted - base[0], st.compared - base[1], st.verifies - base[2]
        out["acceptance"], out["mean_accepted"] = (a / c if c else 0.0), (a / v if v else 0.0)
    return out, [results[r.id] for r in reqs]


def give_idle_time(eng, budget_s: float) -> dict:
    """Idle slices until the engine's drafter has spent its period's budget (or has nothing to learn)."""
    steps, secs, loss = 0, 0.0, float("nan")
    while secs < budget_s:
        done = eng.idle(SLICE_S)
        if done is None:
            break
        steps, secs, loss = steps + done.steps, secs + done.seconds, done.loss
    return {"steps": steps, "seconds": secs, "loss": loss}


def improve(model, reqs, results, examples, task, tok, a, rng) -> None:
    """Rejection-sampling fine-tuning: per prompt, its correct responses no longer than their median
    (RL's pressure against wordiness that earns nothing; all responses where none is correct)."""
    by_prompt: dict[tuple[int, ...], list] = {}
    for r, x, ex in zip(reqs, results, examples):
        if task.reward(ex, tok.decode(x.token_ids)):
            by_prompt.setdefault(r.prompt_ids, []).append((r, x))
    pool = []
    for group in by_prompt.values():
        group.sort(key=lambda rx: len(rx[1].token_ids))
        pool += group[: (len(group) + 1) // 2]
    pool = pool or list(zip(reqs, results))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    model.train()
    for _ in range(a.sft_steps):
        batch = rng.sample(pool, min(16, len(pool)))
        seqs = [r.prompt_ids + x.token_ids for r, x in batch]
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.int64)
        mask = torch.zeros(len(seqs), T)
        for i, ((r, _), s) in enumerate(zip(batch, seqs)):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, len(r.prompt_ids) : len(s)] = 1
        logits = model(ids[:, :-1])
        nll = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        loss = (nll * mask[:, 1:].flatten()).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(1)
    policy = load_pretrained(ensure_warm_start(ArchConfig(), SFTConfig()), dtype=torch.float32)
    tok, task = char_tokenizer(), ChainSumTask()
    exs = task.examples("train", a.prompts, seed=11)
    prompts = [tuple(tok.encode(e.question, bos=True)) for e in exs]
    budget = max(a.first_train_s, a.train_s)  # per idle period; the bench gives each period what it says
    opts = SpecOptions(f"trained{a.layers}" if a.layers > 1 else "trained", toggle=False, train_s=budget)
    engines = {
        name: TailraceEngine(copy.deepcopy(policy), num_slots=a.slots, seed=0, kv_memory_gb=0.5, spec=spec)
        for name, spec in (("off", None), ("frozen", opts), ("refreshed", opts))
    }
    print(f"{a.prompts} prompts x {a.samples} samples through {a.slots} slots, fp32, drafter {opts.drafter} "
          f"(toggle off), policy RFT lr {a.lr} x {a.sft_steps} steps a version, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    print(f"{'version':>7} {'acc':>4} {'len':>4} | off tail ms/tok | frozen: {'accept':>6} {'acc/ver':>7} "
          f"{'fp/tok':>6} {'tail x':>6} {'cpu x':>5} {'all x':>5} | refreshed: {'accept':>6} {'acc/ver':>7} "
          f"{'fp/tok':>6} {'tail x':>6} {'cpu x':>5} {'all x':>5} | drafter training before: steps ms/step "
          f"loss | policy update s | load")  # fmt: skip
    rng, rows, trained, update_s = (
        random.Random(0),
        [],
        {"steps": 0, "seconds": 0.0, "loss": float("nan")},
        0.0,
    )
    scored = [e for e in exs for _ in range(a.samples)]
    for v in range(a.versions):
        params = dict(temperature=1.0, max_new_tokens=a.max_new, stop_token_ids=(tok.eos_id,))
        reqs = [
            GenRequest(
                f"v{v}-p{i}-s{j}", ids, SamplingParams(seed=(v * 1_000 + i) * 100 + j, **params), version=v
            )
            for i, ids in enumerate(prompts)
            for j in range(a.samples)
        ]
        runs, ref = {}, None
        for name, eng in engines.items():
            runs[name], res = rollout(eng, reqs, a.tail)
            toks = [x.token_ids for x in res]
            if ref is not None and toks != ref:
                raise SystemExit(f"version {v}: {name} changed the outputs")
            ref, results = toks, res  # the same results in every engine
        off = runs["off"]
        acc = sum(task.reward(e, tok.decode(x.token_ids)) for e, x in zip(scored, results)) / len(results)
        rows.append(
            {"version": v, "accuracy": acc, "runs": runs, "refreshed_training": trained, "update_s": update_s}
        )
        cells = []
        for name in ("frozen", "refreshed"):
            s = runs[name]
            cells.append(f"{s['acceptance']:6.2f} {s['mean_accepted']:7.2f} {s['tail_fpt']:6.2f} "
                         f"{off['tail_wall'] / s['tail_wall']:5.2f}x {off['tail_cpu'] / s['tail_cpu']:4.2f}x "
                         f"{off['cpu'] / s['cpu']:4.2f}x")  # fmt: skip
        ms = 1e3 * trained["seconds"] / trained["steps"] if trained["steps"] else 0.0
        print(f"{v:7d} {acc:4.2f} {off['mean_len']:4.0f} | {off['tail_wall'] * 1e3:14.2f} | frozen: {cells[0]} | "
              f"refreshed: {cells[1]} | {trained['steps']:5d} {ms:6.1f} {trained['loss']:5.2f} | {update_s:15.1f} "
              f"| {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        if v + 1 == a.versions:
            break
        t = time.perf_counter()
        improve(policy, reqs, results, scored, task, tok, a, rng)
        update_s = time.perf_counter() - t
        trained = give_idle_time(engines["refreshed"], a.first_train_s if v == 0 else a.train_s)
        if v == 0:
            rows[-1]["frozen_training"] = give_idle_time(engines["frozen"], a.first_train_s)
        for eng in engines.values():
            eng.load_weights(policy.state_dict(), v + 1)
            eng.drop_version(v)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
