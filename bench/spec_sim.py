"""bench/spec_sim.py: what speculative decoding gives at cluster scale, in the simulator.

    .venv/bin/python bench/spec_sim.py          # ~1 min

The simulator's expected-value model (sim/costs.py `spec_factor`, sim/engine.py): a verify step runs
gamma + 1 query tokens per row with the weights and KV read once and yields (1 - a^(g+1)) / (1 - a)
tokens per row; the toggle speculates only where that predicts >= 1.05x, so it turns on as a round's
batch thins out (the tail) and off while the batch is compute-bound. Acceptance alpha is an input:
bench/spec.py measures it per drafter (history drafts on the default task: 0.48 in epoch 1, 0.73 in
epoch 2 at temperature 1). Rows: the DARTS-sized GPU workload of bench/shaping.py (Qwen2.5-7B on H800,
4 engines + 4 trainer GPUs, 64 prompts x 8, 16k limit), sync and multiversion, 3 seeds, 16 steps.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailrace.sim.scenario import load_scenario, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPU = ["--cluster.hardware=h800", "--cluster.model=qwen2.5-7b", "--cluster.engines=4", "--cluster.slots=0",
       "--cluster.trainer_gpus=4", "--flow.prompts_per_round=64", "--flow.train_batch=512", "--train_size=256",
       "--lengths={kind: lognormal, median: 3000, max_len: 16384, sigma_prompt: 0.7, sigma_sample: 0.6, "
       "runaway: 0.02, prompt: 512}", "--flow.steps=16", "--journal=false"]  # fmt: skip


def run(mode: str, alpha: float, seed: int) -> dict:
    scn = load_scenario(
        ROOT / "examples" / "sim-shaping.yaml",
        [*GPU, f"--flow.mode={mode}", f"--spec.alpha={alpha}", f"--seed={seed}"],
    )
    return simulate(scn)


def main() -> None:
    print(__doc__.splitlines()[0])
    print(f"{'mode':14s} {'alpha':>5s} {'s/step':>8s} {'vs no spec':>10s} {'vs sync':>8s} {'spec on':>8s}")
    base = {}
    for mode in ("sync", "multiversion"):
        for alpha in (0.0, 0.5, 0.7, 0.9):
            res = [run(mode, alpha, seed) for seed in range(3)]
            step = statistics.mean(r["time_per_step_s"] for r in res)
            base.setdefault(mode, step)
            sync = base["sync"]
            on = statistics.mean(r["spec_on_fraction"] for r in res)
            print(
                f"{mode:14s} {alpha:5.1f} {step:8.1f} {base[mode] / step:9.2f}x {sync / step:7.2f}x {on:8.0%}"
            )


if __name__ == "__main__":
    main()
