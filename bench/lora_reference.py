"""A LoRA trainer started from an adapter (`train.lora.init`) with a KL penalty: its reference as a merged
second copy of the model (before 2026-12-03) against the start adapter kept beside the trained one on
the same base (`lora.set_reference`). Each arm in a fresh process, in turn, in one invocation.

    .venv/bin/python bench/lora_reference.py                  # /tmp/smolshape (106M), 3 steps each
    .venv/bin/python bench/lora_reference.py --model DIR --steps 5

Per arm: the process's peak resident memory (ru_maxrss) after its steps, and the median step time
(forward with the reference, backward, AdamW) over 16 sequences of 64 prompt + 64 response tokens,
rank 8 on every projection, fp32, one thread. Both arms' KL and loss must agree (the same reference),
which the script checks.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def arm(kind: str, model_dir: str, steps: int) -> dict:
    import torch

    from tailrace.config.train import LoraConfig, LossConfig, TrainerConfig
    from tailrace.model import lora
    from tailrace.model.checkpoint import load_pretrained
    from tailrace.trainer.grpo import GRPOTrainer
    from tailrace.types import Finish, GenResult, Group, Trajectory

    torch.set_num_threads(1)
    lc = LoraConfig(rank=8, alpha=16.0)
    base = load_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    start = lora.attach(copy.deepcopy(base), lc)
    with torch.no_grad():
        for m in start.modules():
            if isinstance(m, lora.LoRALinear):
                m.lora_B.weight.normal_(0.0, 0.01)
    init = lora.adapter_of(start)
    del start
    ref = lora.merged(copy.deepcopy(base), init).requires_grad_(False) if kind == "copy" else None
    tr = GRPOTrainer(base, TrainerConfig(lr=1e-3, loss=LossConfig(kl_coef=0.05), lora=lc), ref_model=ref)
    lora.load_adapter_into(tr.model, init)
    if kind == "adapter":
        lora.set_reference(tr.model, init)
    rng = random.Random(0)
    vocab = base.config.vocab_size
    times, out = [], []
    for s in range(steps):
        groups = []
        for g in range(4):
            trajs = []
            for i in range(4):
                prompt = tuple(rng.randrange(4, vocab) for _ in range(64))
                resp = tuple(rng.randrange(4, vocab) for _ in range(64))
                res = GenResult(f"{g}-{i}", resp, (-5.0,) * 64, (s,) * 64, Finish.STOP)
                trajs.append(Trajectory(g, i, g, prompt, res, float(i % 2), i % 2 == 0))
            groups.append(Group(id=g, prompt_id=g, trajectories=tuple(trajs)))
        t0 = time.perf_counter()
        m = tr.step(groups, trainer_version=s)
        times.append(time.perf_counter() - t0)
        out.append((m["kl"], m["loss"]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "kind": kind,
        "peak_mb": peak,
        "step_s": statistics.median(times),
        "metrics": out,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="/tmp/smolshape")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.arm:
        print(json.dumps(arm(a.arm, a.model, a.steps)))
        return 0
    rows = {}
    for kind in ("copy", "adapter"):
        cmd = [sys.executable, __file__, "--arm", kind, "--model", a.model, "--steps", str(a.steps)]
        rows[kind] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    for k in range(a.steps):
        (kc, lc), (ka, la) = rows["copy"]["metrics"][k], rows["adapter"]["metrics"][k]
        assert abs(kc - ka) <= 1e-4 * max(1.0, abs(kc)) and abs(lc - la) <= 1e-4 * max(1.0, abs(lc)), (
            k,
            kc,
            ka,
        )
    print(
        f"{a.model}: KL reference of a run started from an adapter, rank 8, fp32, one thread, {a.steps} steps"
    )
    print("| reference | peak MB | step s |")
    print("|---|---|---|")
    for kind, label in (
        ("copy", "merged copy of the model"),
        ("adapter", "start adapter beside the trained one"),
    ):
        r = rows[kind]
        print(f"| {label} | {r['peak_mb']:,.0f} | {r['step_s']:.2f} |")
    c, d = rows["copy"], rows["adapter"]
    print(f"saved {c['peak_mb'] - d['peak_mb']:,.0f} MB of peak memory; step time {d['step_s'] / c['step_s']:.2f}x; "
          "KL and loss agree at every step")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
