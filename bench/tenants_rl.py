"""Multi-tenant LoRA RL: N tenants (each its own prompt stream, adapter, AdamW and sync-mode scheduler)
on one frozen base and one engine, all at once vs one after another (#19 item 3, second figure).

    .venv/bin/python bench/tenants_rl.py                   # 4 tenants, 12 steps each
    .venv/bin/python bench/tenants_rl.py --tenants 1,8 --steps 8

The base is the built-in warm start (`tailrace sft`, cached; built on first use, ~4 min) on the
default task (chainsum); tenant t trains on the stream of `task.seed = t` and is evaluated on its
held-out set (pass@1 at temperature 1, each prompt seeded) before and after. Both arms run
`runtime.tenants.Tenants` in this one process on one engine (one thread): **one by one** runs each
tenant alone, in turn; **together** adds every tenant at once, so one engine step decodes every
tenant's rows and the trainers' orders queue, run between engine steps. Seeded requests
give the same tokens whatever shares the batch, so each tenant's run is the same in every arm up to
float noise: its accuracy should agree, and the time is what differs. Printed: wall time, samples/s,
engine slot use (decode rows per step / slots, time-weighted), the engine's and the trainers' seconds,
and each tenant's held-out accuracy after each arm.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import RunConfig, TrainerConfig  # noqa: E402
from tailrace.config.train import LoraConfig  # noqa: E402
from tailrace.engine import TailraceEngine  # noqa: E402
from tailrace.flow.policies import make_policy  # noqa: E402
from tailrace.flow.scheduler import FlowSpec, Scheduler  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.runtime.session import Session  # noqa: E402
from tailrace.runtime.tenants import Tenant, Tenants  # noqa: E402
from tailrace.tasks.base import Example  # noqa: E402
from tailrace.trainer.grpo import GRPOTrainer  # noqa: E402
from tailrace.types import GenRequest, Prompt, SamplingParams  # noqa: E402

ARMS = {"one by one": False, "together": True}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", default="4")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per tenant")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (groups)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--eval-n", type=int, default=256)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu or cuda: the engine and every tenant's trainer")
    p.add_argument("--arms", default=",".join(ARMS), help="which arms, by name (comma-separated)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "tenants_rl.json"))
    return p.parse_args(argv)


class Setup:
    def __init__(self, a):
        self.a = a
        self.cfg = RunConfig()
        self.ses = Session(self.cfg)  # the warm start, its tokenizer, the task
        self.base = load_pretrained(self.ses.model_path, dtype=torch.float32).eval().to(a.device)
        self.eng = TailraceEngine(self.base, num_slots=a.slots, seed=0, threads=1, device=a.device)

    def stream(self, seed: int):
        for ex in self.ses.task.stream("train", seed=seed):
            yield self.ses.prompt(ex)

    def reward(self, p: Prompt, ids: tuple[int, ...]) -> tuple[float, bool]:
        stop = self.ses.stop_ids
        text = self.ses.tok.decode(ids[:-1] if ids and ids[-1] in stop else ids)
        r = float(self.ses.task.reward(Example(p.id, p.text, p.answer), text))
        return r, r >= 1.0

    def tenant(self, t: int, steps: int | None = None) -> Tenant:
        a = self.a
        spec = FlowSpec(a.prompts, a.group, a.prompts, steps or a.steps)
        params = SamplingParams(temperature=1.0, max_new_tokens=a.max_new, stop_token_ids=self.ses.stop_ids)
        sched = Scheduler(make_policy("sync"), self.stream(t), [(a.slots, a.slots)], spec, params, seed=t)
        torch.manual_seed(t)
        cfg = TrainerConfig(lr=a.lr, lora=LoraConfig(rank=a.rank, alpha=2.0 * a.rank))
        return Tenant(f"t{t}", sched, GRPOTrainer(copy.deepcopy(self.base), cfg), self.reward)

    def accuracy(self, t: int, adapter) -> float:
        """pass@1 at temperature 1 on tenant t's held-out prompts (task seed t), each seeded by its prompt
        (the same requests at every evaluation, as `runtime.evaluate`), with `adapter` (None: the base)."""
        name = ""
        if adapter is not None:
            name = f"eval{t}"
            self.eng.load_adapter(name, adapter)
        prompts = [self.ses.prompt(ex) for ex in self.ses.task.examples("test", self.a.eval_n, seed=t)]
        reqs = [
            GenRequest(
                f"e{i}",
                p.token_ids,
                SamplingParams(
                    max_new_tokens=self.a.max_new,
                    stop_token_ids=self.ses.stop_ids,
                    seed=zlib.crc32(f"eval/{p.id}".encode()),
                ),
                adapter=name,
            )
            for i, p in enumerate(prompts)
        ]
        res = self.eng.generate(reqs)
        if name:
            self.eng.drop_adapter(name)
        return sum(self.reward(p, r.token_ids)[1] for p, r in zip(prompts, res)) / len(prompts)


def arm(setup: Setup, n: int, together: bool) -> dict:
    t0 = time.perf_counter()
    tenants = [setup.tenant(t) for t in range(n)]
    pools = []
    for group in [tenants] if together else [[t] for t in tenants]:
        pool = Tenants(setup.eng)
        for t in group:
            pool.add(t)
        pool.run()
        pools.append(pool)
    wall = time.perf_counter() - t0
    busy = sum(p.busy_s for p in pools)
    train = sum(m["time_s"] for t in tenants for m in t.steps)
    samples = sum(t.scheduler.ledger.produced for t in tenants)
    return {
        "wall_s": wall,
        "samples": samples,
        "engine_s": busy,
        "train_s": train,
        "slot_use": sum(p.slot_s for p in pools) / busy / setup.a.slots if busy else 0.0,
        "accuracy": [setup.accuracy(t, tn.trainer.adapter()) for t, tn in enumerate(tenants)],
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(1)
    setup = Setup(a)
    ns = [int(x) for x in a.tenants.split(",")]
    print(
        f"base {setup.ses.model_path.name}, {setup.base.num_parameters() / 1e6:.2f}M parameters; "
        f"{a.steps} steps of {a.prompts} x {a.group} per tenant, LoRA rank {a.rank}, lr {a.lr}, {a.device}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    warm = setup.tenant(99, steps=1)  # warm-up: the kernels, the trainer's first step, the allocator
    pool = Tenants(setup.eng)
    pool.add(warm)
    pool.run()
    base_acc = [setup.accuracy(t, None) for t in range(max(ns))]
    print("held-out accuracy of the base, per tenant:", ", ".join(f"{x:.1%}" for x in base_acc))
    rows = []
    for n in ns:
        rows.append({"tenants": n, **{k: arm(setup, n, ARMS[k]) for k in a.arms.split(",")}})
    print(
        "\n| tenants | arm | wall s | samples/s | slot use | engine s | train s | held-out accuracy per tenant |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        for k in [k for k in ARMS if k in row]:
            r = row[k]
            accs = ", ".join(f"{x:.1%}" for x in r["accuracy"])
            print(
                f"| {row['tenants']} | {k} | {r['wall_s']:.1f} | {r['samples'] / r['wall_s']:.1f} | "
                f"{r['slot_use']:.0%} | {r['engine_s']:.1f} | {r['train_s']:.1f} | {accs} |"
            )
        if "one by one" in row:
            alone = row["one by one"]["wall_s"]
            ratios = ", ".join(f"{k} {alone / row[k]['wall_s']:.2f}x" for k in list(ARMS)[1:] if k in row)
            print(f"| {row['tenants']} | one by one's wall time over | {ratios} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps({"args": vars(a), "base_accuracy": base_acc, "rows": rows}, indent=2) + "\n"
    )
    print(f"load average now {os.getloadavg()[0]:.2f}; wrote {a.out}")
    setup.ses.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
