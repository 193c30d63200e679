"""Speculative decoding in rollouts: rollout time with and without each drafter, side by side.

    .venv/bin/python bench/spec.py                       # off, history, quant8; 2 epochs; 3 rounds
    .venv/bin/python bench/spec.py --drafters off,history --rounds 5 --dtype bf16
    .venv/bin/python bench/spec.py --drafters off,trained --rounds 3  # the trained drafter (TLT)
    .venv/bin/python bench/spec.py --batches 1,2,4,8,16,32,64   # the toggle at fixed active batches

The model is the warm-started chainsum policy (`ensure_warm_start`, cached); the workload an RL round:
`--prompts` chainsum training prompts x `--samples` samples each (temperature 1, EOS stops, up to
`--max-new` tokens) through `--slots` slots, so the batch drains from full to a long tail. Epoch 1 has
no history; epoch 2 samples the same prompts again (new seeds) with the first epoch's responses given
to the engine (`add_history`): the task's prompts recur across epochs. Each run is a fresh engine
(speculation's cost model first learns from a warm-up round of other prompts, and a trained drafter
from its responses and the history, in the engine's idle budget, `SpecOptions.train_s`), and the configurations
take turns run by run, `--rounds` times, so the machine's drift falls on all alike; medians are shown.

Per drafter and epoch: rollout seconds and tokens/s vs off (and the ratio of the thread's CPU
seconds, which load from other processes barely moves); the tail phase (steps with at most
`--tail` active rows): tokens/s vs off and forward passes per generated token (rows in a target
forward / tokens they emitted; 1.0 without speculation); acceptance (per draft token) and mean
accepted drafts per verify; and the share of decode rows that verified a draft by active batch.
Outputs are checked identical to a run without speculation on an engine built batch-invariant
(`off-inv`, untimed unless named in `--drafters`), token for token: a speculating engine is
batch-invariant, and in bf16 the default plain engine (`off`, the speed baseline) is not -- its rows'
attention moves with the batch size -- so in bf16 `off` is not compared (its requests that differ
from the reference are counted). `off-inv` in `--drafters` times that engine too: the price of batch
invariance without speculation.

`--batches`: the toggle's promise (never more than 3% slower than no speculation) at fixed active
batches: b requests of exactly `--max-new` tokens (EOS banned, so the batch stays b), on one engine
per drafter kept across repetitions (its cost model learns from a warm-up call first), the history
drafter given an earlier epoch's responses; the engines take turns call by call. Shown: the median
of the per-turn ratios (no speculation's seconds over the drafter's, in the thread's CPU seconds, what
load from other processes barely moves, and in wall seconds) with a 95% bootstrap interval, and the
verdict on the CPU ratio: `kept` where the whole interval is >= 0.97x, `BROKEN` where it is all below,
`undecided` where these turns cannot tell.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import ArchConfig, SFTConfig  # noqa: E402
from tailrace.engine import TailraceEngine  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.runtime.session import ModelText  # noqa: E402
from tailrace.runtime.warmstart import ensure_warm_start  # noqa: E402
from tailrace.tasks.chainsum import ChainSumTask  # noqa: E402
from tailrace.tokenizer import char_tokenizer  # noqa: E402
from tailrace.types import GenRequest, SamplingParams  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64)  # on-fraction columns: active batch up to this


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default="off,history,quant8")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-new", type=int, default=384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--tail", type=int, default=8)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu", help="cpu or cuda (on CUDA the wall-clock columns count)")
    p.add_argument(
        "--model",
        help="a local HF checkpoint (e.g. SmolLM2-135M-Instruct) instead of the warm-started policy: "
        "its prompts are --questions rendered through its chat template",
    )
    p.add_argument("--questions", help="a JSONL file of {question: ...} (default: step-by-step arithmetic)")
    p.add_argument("--batches", default="", help="comma-separated active batches: the toggle check")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "spec.json"))
    return p.parse_args(argv)


def round_requests(prompts, samples: int, max_new: int, stops: tuple, epoch: int) -> list[GenRequest]:
    params = dict(temperature=1.0, max_new_tokens=max_new, stop_token_ids=stops)
    return [
        GenRequest(f"e{epoch}-p{i}-s{j}", ids, SamplingParams(seed=(epoch * 1_000 + i) * 100 + j, **params))
        for i, ids in enumerate(prompts)
        for j in range(samples)
    ]


def build(model, d: str, slots: int, a, **kw) -> TailraceEngine:
    """The engine of configuration `d`: 'off' (no speculation), 'off-inv' (none, batch-invariant) or a
    drafter's name."""
    if d.startswith("off"):
        return TailraceEngine(
            model, num_slots=slots, seed=0, device=a.device, batch_invariant=d == "off-inv", **kw
        )
    return TailraceEngine(model, num_slots=slots, seed=0, device=a.device, spec=d, **kw)


def checked(d: str, a) -> bool:
    """Whether configuration `d`'s tokens must equal the batch-invariant reference (see doc)."""
    return d != "off" or a.dtype == "fp32"


def run(model, d, reqs, warmup, history, a) -> dict:
    """One rollout of configuration `d` on a fresh engine; its steps' records and the results."""
    eng = build(model, d, a.slots, a, kv_memory_gb=0.5)
    eng.generate(warmup)
    for prompt, tokens in history:
        eng.add_history(prompt, tokens)
    while eng.idle(0.05):  # a trained drafter learns from the warm-up and the history (its idle budget)
        pass
    base = eng.spec_stats and _snap(eng.spec_stats)
    for r in reqs:
        eng.add(r)
    steps, results = [], {}
    t0, c0 = time.perf_counter(), time.thread_time()
    while len(results) < len(reqs):
        ev = eng.step()
        steps.append((ev.active, ev.decode_tokens, ev.duration, ev.prefill_tokens))
        for res in ev.finished:
            results[res.request_id] = res
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    out = {
        "wall": wall,
        "cpu": cpu,
        "steps": steps,
        "tokens": sum(len(r.token_ids) for r in results.values()),
    }
    if eng.spec_stats:
        out["spec"] = _diff(_snap(eng.spec_stats), base)
    out["results"] = [results[r.id] for r in reqs]
    return out


def _snap(st) -> dict:
    return {
        "drafted": st.drafted,
        "accepted": st.accepted,
        "compared": st.compared,
        "verifies": st.verifies,
        "by_batch": {b: list(v) for b, v in st.by_batch.items()},
        "draft_s": st.draft_s,
        "draft_passes": st.draft_passes,
        "gamma": st.gamma,
    }


def _diff(now: dict, then: dict) -> dict:
    out = {
        k: now[k] - then[k]
        for k in ("drafted", "accepted", "compared", "verifies", "draft_s", "draft_passes")
    }
    out["gamma"] = now["gamma"]
    out["by_batch"] = {
        b: [v[0] - then["by_batch"].get(b, [0, 0])[0], v[1] - then["by_batch"].get(b, [0, 0])[1]]
        for b, v in now["by_batch"].items()
    }
    return out


def summarize(r: dict, tail: int) -> dict:
    dec = [(a, n, d) for a, n, d, p in r["steps"] if a and not p]  # decode-only steps
    t_steps = [(a, n, d) for a, n, d in dec if a <= tail]
    s = {
        "wall": r["wall"],
        "cpu": r["cpu"],
        "tok_s": r["tokens"] / r["wall"],
        "tail_tok_s": sum(n for _, n, _ in t_steps) / max(1e-9, sum(d for _, _, d in t_steps)),
        "tail_fpt": sum(a for a, _, _ in t_steps) / max(1, sum(n for _, n, _ in t_steps)),
        "fpt": sum(a for a, _, _ in dec) / max(1, sum(n for _, n, _ in dec)),
    }
    sp = r.get("spec")
    if sp:
        s["acceptance"] = sp["accepted"] / sp["compared"] if sp["compared"] else 0.0
        s["mean_accepted"] = sp["accepted"] / sp["verifies"] if sp["verifies"] else 0.0
        s["gamma"] = sp["gamma"]
        on = {}
        for lim in BATCHES:
            rows = sum(v[0] for b, v in sp["by_batch"].items() if b <= lim and (lim == 1 or b > lim // 2))
            ver = sum(v[1] for b, v in sp["by_batch"].items() if b <= lim and (lim == 1 or b > lim // 2))
            on[lim] = ver / rows if rows else None
        s["on"] = on
    return s


def questions(a) -> list[str]:
    """--questions' lines, or step-by-step arithmetic a small instruct model answers at length."""
    if a.questions:
        with open(a.questions) as f:
            return [json.loads(line)["question"] for line in f if line.strip()]
    rng = random.Random(11)
    forms = (
        "Solve step by step: what is {a} + {b} * {c}?",
        "Explain step by step how to compute {a} * {b} - {c}.",
        "A shop sells {a} apples a day for {b} days, then {c} more. Show your work: how many in all?",
    )
    return [
        rng.choice(forms).format(a=rng.randint(12, 99), b=rng.randint(3, 19), c=rng.randint(5, 60))
        for _ in range(a.prompts + 64)
    ]


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    if a.model:
        text = ModelText(Path(a.model))
        model = load_pretrained(a.model, dtype=dtype)
        qs = questions(a)
        ids = [tuple(text.chat.ids(q) if text.chat else text.tok.encode(q, bos=True)) for q in qs]
        prompts, others, eos = ids[: a.prompts], ids[a.prompts :][:64], text.stop_ids
    else:
        model = load_pretrained(ensure_warm_start(ArchConfig(), SFTConfig()), dtype=dtype)
        tok = char_tokenizer()
        exs = ChainSumTask().examples("train", a.prompts + 64, seed=11)
        prompts = [tuple(tok.encode(e.question, bos=True)) for e in exs[: a.prompts]]
        others = [tuple(tok.encode(e.question, bos=True)) for e in exs[a.prompts :]]
        eos = (tok.eos_id,)
    warmup = round_requests(others, 1, a.max_new, eos, epoch=99)
    drafters = a.drafters.split(",")
    if a.batches:
        return toggle_check(model, prompts, drafters, [int(b) for b in a.batches.split(",")], a)
    print(f"{a.prompts} prompts x {a.samples} samples through {a.slots} slots, {a.dtype} on {a.device}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    table: dict = {}
    history: list = []
    for epoch in range(1, a.epochs + 1):
        reqs = round_requests(prompts, a.samples, a.max_new, eos, epoch)
        runs: dict[str, list] = {d: [] for d in drafters}
        last = run(model, "off-inv", reqs, warmup, history, a)["results"]  # the reference, untimed
        ref = [x.token_ids for x in last]
        differ: dict[str, int] = {}
        for rnd in range(a.rounds):
            order = drafters if rnd % 2 == 0 else drafters[::-1]
            for d in order:
                r = run(model, d, reqs, warmup, history, a)
                toks = [x.token_ids for x in r.pop("results")]
                n = sum(x != y for x, y in zip(toks, ref))
                if n and checked(d, a):
                    raise SystemExit(f"epoch {epoch}: {d} changed the outputs ({n} of {len(ref)} requests)")
                differ[d] = max(differ.get(d, 0), n)
                runs[d].append(summarize(r, a.tail))
        history = [(reqs[i].prompt_ids, x.token_ids) for i, x in enumerate(last)]
        table[epoch] = {d: _median(runs[d]) for d in drafters}
        report(epoch, table[epoch], a)
        if differ.get("off") and not checked("off", a):
            print(
                f"  off (not batch-invariant) differed from the reference in {differ['off']} of {len(ref)} requests"
            )
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "table": table}, f, indent=1)
    return 0


def toggle_check(model, prompts, drafters: list[str], batches: list[int], a) -> int:
    """tokens/s of each drafter (toggle on) over no speculation at fixed active batches (see doc)."""
    print(
        f"toggle check: {a.max_new} tokens per request, {a.dtype} on {a.device}, {a.rounds} turns", flush=True
    )
    table = {}
    for b in batches:
        ps = [prompts[i % len(prompts)] for i in range(b)]
        fixed = dict(temperature=1.0, max_new_tokens=a.max_new, min_new_tokens=a.max_new)
        mk = lambda tag, j: [  # noqa: E731
            GenRequest(f"{tag}{i}", p, SamplingParams(seed=j * 10_000 + i, **fixed)) for i, p in enumerate(ps)
        ]
        engines = {d: build(model, d, b, a) for d in drafters}
        reference = engines["off-inv"] if "off-inv" in engines else build(model, "off-inv", b, a)
        earlier = reference.generate(mk("h", 99))
        for eng in engines.values():
            for p, r in zip(ps, earlier):
                eng.add_history(p, r.token_ids)
            eng.generate(mk("w", 98))  # warm-up: the toggle learns this batch's costs
        secs, cpu = {d: [] for d in drafters}, {d: [] for d in drafters}
        for rnd in range(a.rounds):
            reqs = mk("m", rnd)
            ref = [r.token_ids for r in reference.generate(reqs)]  # untimed
            for d in drafters if rnd % 2 == 0 else drafters[::-1]:
                t, c = time.perf_counter(), time.thread_time()
                out = engines[d].generate(reqs)
                secs[d].append(time.perf_counter() - t)
                cpu[d].append(time.thread_time() - c)
                toks = [r.token_ids for r in out]
                n = sum(x != y for x, y in zip(toks, ref))
                if n and checked(d, a):
                    raise SystemExit(f"batch {b}: {d} changed the outputs ({n} of {b} requests)")
        med = statistics.median(secs["off"])
        on = {d: e.spec_stats.on_fraction().get(b, 0.0) for d, e in engines.items() if e.spec_stats}
        table[b] = {
            d: {"wall": paired_ratio(secs["off"], secs[d]), "cpu": paired_ratio(cpu["off"], cpu[d]), "on": on.get(d)}
            for d in drafters
        }  # fmt: skip
        print(f"batch {b:3d}: off {b * a.max_new / med:8,.0f} tok/s | "
              + " ".join(f"{d} {_ci(table[b][d]['cpu'])} cpu {_ci(table[b][d]['wall'])} wall (on {on.get(d, 0.0):.2f}) "
                         f"{verdict(table[b][d]['cpu'])}" for d in drafters if d != "off")
              + f" | load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "toggle": table}, f, indent=1)
    return 0


def paired_ratio(base: list[float], other: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The median of the per-turn ratios base/other (a turn's two calls run back to back, so a slow
    moment of the machine hits both) and a 95% bootstrap interval of that median (seeded)."""
    ratios = [x / y for x, y in zip(base, other)]
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def verdict(r: tuple[float, float, float], bound: float = 0.97) -> str:
    """The toggle's promise (never more than 3% slower) at this resolution: kept where the whole
    interval is at or above 0.97x, broken where it is all below, else not decided by these turns."""
    return "kept" if r[1] >= bound else "BROKEN" if r[2] < bound else "undecided"


def _ci(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.3f}x [{r[1]:.3f}, {r[2]:.3f}]"


def _median(runs: list[dict]) -> dict:
    out = {}
    for k, v in runs[0].items():
        if isinstance(v, dict):
            out[k] = {
                b: (
                    statistics.median(x[k][b] for x in runs)
                    if all(x[k][b] is not None for x in runs)
                    else None
                )
                for b in v
            }
        else:
            out[k] = statistics.median(x[k] for x in runs)
    return out


def report(epoch: int, rows: dict, a) -> None:
    off = rows.get("off")
    print(f"\nepoch {epoch}" + (" (history: epoch 1's responses)" if epoch > 1 else " (no history)"))
    print(f"{'drafter':8} {'rollout s':>9} {'tok/s':>8} {'x off':>6} {'cpu x':>6} | tail(<= {a.tail}): {'tok/s':>8} "
          f"{'x off':>6} {'fp/tok':>6} | {'accept':>6} {'acc/ver':>7} {'gamma':>5} | on-fraction by batch")  # fmt: skip
    for d, s in rows.items():
        on = s.get("on")
        on_s = " ".join(f"{b}:{'-' if v is None else f'{v:.2f}'}" for b, v in on.items()) if on else ""
        # no tail phase (every step above `--tail` rows: few prompts): no tail figures
        tail = off["tail_tok_s"] and f"{s['tail_tok_s'] / off['tail_tok_s']:5.2f}x"
        print(
            f"{d:8} {s['wall']:9.2f} {s['tok_s']:8,.0f} {off['wall'] / s['wall']:5.2f}x "
            f"{off['cpu'] / s['cpu']:5.2f}x | {'':13}"
            f"{s['tail_tok_s']:8,.0f} {tail or '    -':>6} {s['tail_fpt']:6.2f} | "
            f"{s.get('acceptance', 0):6.2f} {s.get('mean_accepted', 0):7.2f} {s.get('gamma', 0):5} | {on_s}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
