"""Routing replay (R3, `train.routing_replay`), measured: how far a mixture of experts' trainer logprobs
lie from the engine's that sampled them, with the trainer routing each token afresh and with it taking
the experts the engine chose, side by side on the same rollouts.

    .venv/bin/python bench/routing_replay.py --model DIR       # an MoE checkpoint (Qwen3-MoE, OLMoE, ...)
    .venv/bin/python bench/routing_replay.py                   # builds the warm-start recipe's Qwen3-MoE
                                                               # layout once (~10 min, cached)

Workload: `--prompts` held-out chainsum prompts x `--samples` samples (temperature 1, EOS stops, up to
`--max-new` tokens) through tailrace's engine (C kernels on CPU, `--slots` rows), recording routes, per
seed. Each round is judged by the trainer (`GRPOTrainer.evaluate` at the version that sampled it: the
same weights, so any gap is numerics, and routing): fp32 weights with bf16 autocast, as `train.bf16`
runs, against an engine in bf16 (`model.dtype=bfloat16`, a GPU's default); and, as the floor, both in
fp32. Per configuration: the gap |trainer logprob - engine logprob| over the sampled tokens (mean, p99,
max, the fraction past 0.1 nats), the largest importance ratio exp(gap) the loss would see, and the
fraction of (position, sparse layer)s whose replayed experts the trainer would not have chosen; and
what recording the routes costs a rollout: its seconds with and without, best of `--repeats` each,
alternating (the tokens must come out the same).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import ArchConfig, SFTConfig, TrainerConfig  # noqa: E402
from tailrace.engine import TailraceEngine  # noqa: E402
from tailrace.model import load_pretrained  # noqa: E402
from tailrace.model.moe import replaying, take_load  # noqa: E402
from tailrace.runtime import warmstart  # noqa: E402
from tailrace.tasks.chainsum import ChainSumTask  # noqa: E402
from tailrace.tokenizer import load_tokenizer  # noqa: E402
from tailrace.trainer.grpo import GRPOTrainer  # noqa: E402
from tailrace.trainer.logprobs import token_logprobs  # noqa: E402
from tailrace.types import GenRequest, Group, SamplingParams, Trajectory  # noqa: E402


def moe_warm_start() -> Path:
    """The built-in warm-start recipe on Qwen3-MoE's layout (the built-in shape, 8 experts of width 192,
    2 a token: the dense recipe's active MLP), built once into the cache."""
    out = Path(os.environ.get("TAILRACE_CACHE", ROOT / ".devcache")) / "bench" / "qwen3moe-warmstart"
    if (out / "config.json").exists():
        return out
    dense = warmstart.model_config

    def as_moe(cfg, vocab, tok):
        return dense(cfg, vocab, tok).replace(
            model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
            norm_topk_prob=True,
        )  # fmt: skip

    warmstart.model_config = as_moe
    try:
        print(f"building the Qwen3-MoE warm start into {out} (once) ...", flush=True)
        warmstart.build_warm_start(ArchConfig(), SFTConfig(), out, progress=None)
    finally:
        warmstart.model_config = dense
    return out


WARM: set[torch.dtype] = set()


def rollouts(model, tok, args, seed: int, dtype: torch.dtype) -> tuple[list[Group], float, float]:
    """The round's groups, and the seconds it took with routes recorded and without (the same tokens)."""
    task = ChainSumTask()
    examples = task.examples("test", args.prompts)
    reqs = []
    for ex in examples:
        ids = tuple(tok.encode(ex.question, bos=True))
        for i in range(args.samples):
            rid = f"{ex.id}.{i}"
            params = SamplingParams(
                temperature=1.0,
                max_new_tokens=args.max_new,
                stop_token_ids=(tok.eos_id,),
                seed=(seed * args.prompts + ex.id) * args.samples + i,
            )
            reqs.append(GenRequest(rid, ids, params))
    outs: dict[bool, list] = {}  # each configuration's first rollout (the later ones are the same tokens)
    if dtype not in WARM:  # oneDNN compiles its kernels on the first shapes it meets: not timed
        TailraceEngine(copy.deepcopy(model), num_slots=args.slots, dtype=dtype).generate(reqs[: args.slots])
        WARM.add(dtype)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(args.repeats):  # alternating, best of each: the VM's noise is ~5% a rollout
        for routes in (True, False):
            eng = TailraceEngine(  # a copy: an engine serving the model in its own dtype holds it, frozen
                copy.deepcopy(model), num_slots=args.slots, dtype=dtype, routes=routes, threads=args.threads
            )
            t0 = time.perf_counter()
            got = eng.generate(reqs)
            best[routes] = min(best[routes], time.perf_counter() - t0)
            outs.setdefault(routes, got)
    results, plain = outs[True], outs[False]
    if [r.token_ids for r in results] != [r.token_ids for r in plain]:
        raise SystemExit("recording routes changed a token")
    groups = []
    for ex in examples:
        trajs = []
        for i in range(args.samples):
            res = results[ex.id * args.samples + i]
            r = task.reward(ex, tok.decode(res.token_ids))
            trajs.append(
                Trajectory(ex.id, i, ex.id, reqs[ex.id * args.samples + i].prompt_ids, res, r, r > 0)
            )
        groups.append(Group(ex.id, ex.id, tuple(trajs)))
    return groups, best[True], best[False]


@torch.no_grad()
def judge(model, groups: list[Group], replay: bool, bf16: bool) -> dict[str, float]:
    """The trainer's view of the rollouts: its metrics (`evaluate`) and the per-token gaps."""
    model = copy.deepcopy(model)  # a trainer takes its model's parameters into its flat buffer
    tr = GRPOTrainer(model, TrainerConfig(bf16=bf16, routing_replay=replay, lr=1e-6))
    take_load(model)
    m = tr.evaluate(groups, 0)
    batch = tr.make_batch(groups, 0)
    gaps = []
    for mb in batch.micro_batches(8192):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), replaying(model, mb.routes):
            logp = token_logprobs(model(mb.input_ids), mb.targets)
        sampled = mb.versions >= 0
        gaps.append((logp - mb.behav_logp)[sampled].abs())
    take_load(model)
    g = torch.cat(gaps).double()
    return {
        "tokens": g.numel(), "mean": float(g.mean()), "p99": float(g.quantile(0.99)), "max": float(g.max()),
        "past_0.1": float((g > 0.1).double().mean()), "is_ratio_max": m["is_ratio_max"],
        "flips": m.get("moe_route_flips", float("nan")),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, default=None, help="an MoE checkpoint (default: the recipe's, built once)"
    )
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="rollouts timed per configuration (best of)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or moe_warm_start()
    model = load_pretrained(path, dtype=torch.float32).eval()
    tok = load_tokenizer(path)
    print(
        f"{path}: {model.config.model_type}, {model.config.num_experts} experts, "
        f"{model.config.num_experts_per_tok} a token"
    )
    rows, cost = [], {}
    for name, engine_dtype, bf16 in (
        ("bf16 engine, bf16 trainer", torch.bfloat16, True),
        ("fp32 both", torch.float32, False),
    ):
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            groups, with_routes, without = rollouts(model, tok, args, seed, engine_dtype)
            cost.setdefault(name, []).append(with_routes / without)
            for replay in (False, True):
                r = judge(model, groups, replay, bf16)
                rows.append((name, seed, replay, r))
                print(
                    f"{name:26s} seed {seed} {'replayed' if replay else 'afresh  '}: gap mean {r['mean']:.2e} "
                    f"p99 {r['p99']:.2e} max {r['max']:.2e}, past 0.1 {r['past_0.1']:.2%}, is_ratio_max "
                    f"{r['is_ratio_max']:.3f}, flips {r['flips']:.3%} ({r['tokens']} tokens, "
                    f"{time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    print("\nmean over seeds (afresh -> replayed; ratio afresh / replayed):")
    for name in dict.fromkeys(n for n, *_ in rows):
        for key in ("mean", "p99", "max", "past_0.1"):
            a = [r[key] for n, _, rep, r in rows if n == name and not rep]
            b = [r[key] for n, _, rep, r in rows if n == name and rep]
            ma, mb = sum(a) / len(a), sum(b) / len(b)
            print(f"  {name:26s} gap {key:9s} {ma:.3e} -> {mb:.3e}  ({ma / mb if mb else float('inf'):.2f}x)")
        f = [r["flips"] for n, _, rep, r in rows if n == name and rep]
        print(f"  {name:26s} routes the trainer would have chosen otherwise: {sum(f) / len(f):.3%}")
        c = cost[name]
        print(f"  {name:26s} rollout time recording routes / not: {', '.join(f'{x:.3f}' for x in c)}")


if __name__ == "__main__":
    main()
