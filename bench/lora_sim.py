"""A LoRA run at cluster scale in the simulator: DORA's 64-GPU setup (Qwen2.5-32B on H800, half the GPUs
rolling out in engines of 4, half training; 128 prompts x 8, long-tailed lengths), whole weights against
rank-8 adapters (`cluster.lora_rank`: a version moves and a resident one costs the adapter's bytes, and
the trainer skips the base's weight gradients), per mode. A projection of the cost model, not a
measurement; what training on an adapter does to accuracy is not modelled.

    .venv/bin/python bench/lora_sim.py            # ~1 min
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from sim import dora, steady_step_s  # noqa: E402

from tailrace.sim.scenario import cost_model, simulate  # noqa: E402


def main() -> None:
    print(f"{'mode':14s} {'weights':>8s} {'MB/version':>10s} {'sync s':>7s} {'s/step':>8s} {'vs whole':>8s}")
    for mode in ("sync", "multiversion"):
        base = None
        for rank in (0, 8):
            scn = dora(64, mode, steps=8)
            scn = dataclasses.replace(scn, cluster=dataclasses.replace(scn.cluster, lora_rank=rank))
            cost = cost_model(scn)
            step = steady_step_s(simulate(scn))
            base = base or step
            label = f"LoRA r{rank}" if rank else "whole"
            print(f"{mode:14s} {label:>8s} {cost.version_bytes / 1e6:10,.0f} {cost.load_time():7.2f} "
                  f"{step:8.1f} {base / step:7.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
