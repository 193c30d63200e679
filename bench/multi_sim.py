"""bench/multi_sim.py: several policies trained in one simulated run (`policies`, sharing the rollout
engines, a trainer each) against the same policies trained one after another on the same engines
(#19 item 2; AstraFlow reports multi-policy training 2.7x faster than verl-based training).

    .venv/bin/python bench/multi_sim.py [--steps N] [--policies 2,4] [--modes sync,multiversion]

Every policy draws the same prompts and lengths, so each policy alone is one single-policy run and
one after another is P of them. Devices: the engines', plus one trainer's (`cluster.trainer_gpus`)
per policy together, one trainer's one after another; the device-hours column prices that. Engine
slot use is the engines' slot-time used over slot-time available (1 - bubble ratio) over the arm;
steps/h together is the slowest policy's. "vs sync one after another" sets the arm against P sync
policies trained one after another, the trainer-centred baseline (verl's) that AstraFlow's figure is
measured against.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailrace.sim.scenario import apply_overrides, load_scenario, simulate  # noqa: E402

SETUPS = {
    # verl/AstraFlow scale: a 7B policy on H100s, 8 rollout GPUs (4 engines of TP2, slots sized from
    # KV memory: 256 each) and an 8-GPU trainer per policy; verl's GRPO step of 128 prompts x 8 samples,
    # reasoning-length responses (median 2,000 tokens, 2% run to the 8,192 limit)
    "qwen2.5-7b, h100, 4 engines x TP2 + 8 trainer GPUs a policy": [
        "--cluster.hardware=h100",
        "--cluster.model=qwen2.5-7b",
        "--cluster.engines=4",
        "--cluster.engine_gpus=2",
        "--cluster.slots=0",
        "--cluster.lookahead=0",
        "--cluster.trainer_gpus=8",
        "--flow.prompts_per_round=128",
        "--flow.samples_per_prompt=8",
        "--flow.train_batch=1024",
        "--lengths={kind: lognormal, median: 2000, max_len: 8192, sigma_prompt: 0.6, sigma_sample: 0.5, "
        "runaway: 0.02, prompt: 256}",
    ],
    # the 2-core testbed: the default model on the cpu preset (its calibration, else the built-in fit),
    # one engine of 64 slots and a trainer core a policy; the default flow's sizes and lengths
    "tailrace-default, cpu preset, 1 engine + 1 trainer core a policy": [
        "--cluster.hardware=cpu",
        "--cluster.model=tailrace-default",
    ],
}


def arm(base: list[str], mode: str, policies: int, steps: int) -> dict:
    named = ", ".join(f"{{name: p{i}}}" for i in range(policies)) if policies > 1 else ""
    over = [f"--flow.mode={mode}", f"--flow.steps={steps}", f"--policies=[{named}]", "--journal=false"]
    return simulate(apply_overrides(load_scenario(None, base), over))


def row(setup: list[str], mode: str, P: int, steps: int, alone: dict, sync_alone: dict) -> str:
    both = arm(setup, mode, P, steps)
    after = P * alone["wall_s"]
    per_h = [3600 * f["steps"] / f["wall_s"] for f in both["policies"].values()]
    dev_h = both["gpus"] * both["wall_s"] / (alone["gpus"] * after)
    return (
        f"| {mode} | {P} | {after:,.0f} s | {both['wall_s']:,.0f} s | **{after / both['wall_s']:.2f}x** | "
        f"{P * sync_alone['wall_s'] / both['wall_s']:.2f}x | "
        f"{3600 * alone['steps'] / alone['wall_s']:,.1f} / {min(per_h):,.1f} | "
        f"{1 - alone['bubble_ratio']:.0%} / {1 - both['bubble_ratio']:.0%} | "
        f"{1 - alone['trainer_wait_ratio']:.0%} | {alone['gpus']} / {both['gpus']} | {dev_h:.2f}x |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per policy")
    ap.add_argument("--policies", default="2,4", help="policy counts, comma-separated")
    ap.add_argument("--modes", default="sync,multiversion", help="flow modes, comma-separated")
    args = ap.parse_args()
    counts = [int(p) for p in args.policies.split(",")]
    t0 = time.perf_counter()
    for name, setup in SETUPS.items():
        print(f"\n{name}, {args.steps} steps a policy\n")
        print(
            "| mode | P | one after another | together | speed-up | vs sync one after another "
            "| steps/h a policy: alone / together | engine slot use: after / together | trainer busy alone "
            "| devices: after / together | device-hours: together / after |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        sync_alone = arm(setup, "sync", 1, args.steps)
        for mode in args.modes.split(","):
            alone = sync_alone if mode == "sync" else arm(setup, mode, 1, args.steps)
            for P in counts:
                print(row(setup, mode, P, args.steps, alone, sync_alone), flush=True)
    print(f"\n({time.perf_counter() - t0:.0f} s to simulate)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
