"""flow.ahead in the simulator: multiversion's wall time and mean staleness when admission and train
issuance run up to the staleness bound (null) or only A steps ahead of the trainer. One run per cell
(the simulator is deterministic), 4 h100 engines, qwen3-1.7b, 64 prompts x 8 a round, 128 a step.

    .venv/bin/python bench/ahead_sim.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tailrace.sim.scenario import load_scenario, simulate  # noqa: E402


def run(extra, lengths):
    base = [
        "--cluster.hardware=h100",
        "--cluster.model=qwen3-1.7b",
        "--cluster.engines=4",
        "--flow.prompts_per_round=64",
        "--flow.samples_per_prompt=8",
        "--flow.train_batch=128",
        "--flow.steps=24",
        f"--lengths={lengths}",
        "--journal=false",
        "--flow.mode=multiversion",
    ]
    return simulate(load_scenario(None, base + extra))


for name, lengths in [
    ("gen-bound (median 1000)", "{kind: lognormal, median: 1000, max_len: 8000, prompt: 128}"),
    ("train-bound (median 150)", "{kind: lognormal, median: 150, max_len: 1000, prompt: 128}"),
]:
    for K in (2, 4):
        row = []
        for ahead in ("null", 1, 0):
            s = run([f"--flow.max_staleness={K}", f"--flow.ahead={ahead}"], lengths)
            st = {int(k): v for k, v in s["staleness"].items()}
            mean = sum(k * v for k, v in st.items()) / sum(st.values())
            row.append(
                f"ahead={ahead}: wall {s['wall_s']:.0f}s stale {mean:.2f} wait {s['trainer_wait_ratio']:.2f}"
            )
        print(name, f"K={K}", " | ".join(row))
