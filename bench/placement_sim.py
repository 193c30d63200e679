"""multiversion placement in the simulator: shared (every engine serves every live version) against
dedicated (DORA: a new version goes to the least busy engine, the rest follow as they drain). 8 h100
engines, qwen3-1.7b, 128 prompts x 8 a round, 256 samples a step, 24 steps, lognormal median 1000.

    .venv/bin/python bench/placement_sim.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tailrace.sim.scenario import load_scenario, simulate  # noqa: E402

for eng, slots in ((8, 64), (8, 256)):
    for K in (1, 2):
        row = []
        for placement in ("shared", "dedicated"):
            base = [
                "--cluster.hardware=h100",
                "--cluster.model=qwen3-1.7b",
                f"--cluster.engines={eng}",
                f"--cluster.slots={slots}",
                "--flow.prompts_per_round=128",
                "--flow.samples_per_prompt=8",
                "--flow.train_batch=256",
                "--flow.steps=24",
                "--lengths={kind: lognormal, median: 1000, max_len: 8000, prompt: 128}",
                "--journal=false",
                "--flow.mode=multiversion",
                f"--flow.max_staleness={K}",
                f"--flow.placement={placement}",
            ]
            s = simulate(load_scenario(None, base))
            st = {int(k): v for k, v in s["staleness"].items()}
            mean = sum(k * v for k, v in st.items()) / sum(st.values())
            row.append(
                f"{placement}: wall {s['wall_s']:.0f}s stale {mean:.2f} gen {s['gen_tok_s']:.0f} tok/s"
            )
        print(f"{eng} engines x {slots} slots K={K}:", " | ".join(row), flush=True)
