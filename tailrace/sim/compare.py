"""Real vs simulated: the same figures read from two run directories' metrics.jsonl.

Both runs are read by the same function, so a difference is the simulator's, not the bookkeeping's.
The first step is left out of the means: in a real run it carries start-up (process launch, the base
evaluation) that the simulator does not model.
"""
from __future__ import annotations

import json
from pathlib import Path

FIGURES = ("step_s", "trainer_wait_ratio", "bubble_ratio", "gen_tok_s", "length_bubble")


def step_records(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a run directory written by tailrace train or sim")
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                break
            if r.get("kind") == "step":
                out.append(r)
    return out


def step_figures(run_dir: str | Path, skip: int = 1) -> dict:
    """Means over the steps after the first `skip`: step time, per-step trainer waiting and bubble
    ratios, generated tokens/s, and DORA's length bubble (max - mean) / max."""
    steps = step_records(run_dir)
    use = steps[skip:] if len(steps) > skip else steps
    if not use:
        raise ValueError(f"{run_dir}: no step records")

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs)
    return {"steps": len(steps), "step_s": mean(r["time"]["step_s"] for r in use),
            "trainer_wait_ratio": mean(r["time"]["step_trainer_wait_ratio"] for r in use),
            "bubble_ratio": mean(r["time"]["step_bubble_ratio"] for r in use),
            "gen_tok_s": mean(r["time"]["gen_tok_s"] for r in use),
            "length_bubble": mean(r["length"].get("bubble", 0.0) for r in use)}


def compare(real: dict, sim: dict) -> list[tuple[str, float, float, float]]:
    """(figure, real, simulated, relative error of the simulation)."""
    return [(k, real[k], sim[k], (sim[k] - real[k]) / real[k] if real[k] else float("nan")) for k in FIGURES]
