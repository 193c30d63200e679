"""Real vs simulated: the same figures read from two run directories' metrics.jsonl.

Both runs are read by the same function, so a difference is the simulator's, not the bookkeeping's.
The first step is left out of the means: in a real run it carries start-up (process launch, the base
evaluation) that the simulator does not model.
"""

from __future__ import annotations

from pathlib import Path

from tailrace.records import Span, StepRecord, read_events, read_journal, read_metrics, trained_by_step

FIGURES = ("step_s", "train_s", "rollout_s", "trainer_wait_ratio", "bubble_ratio", "length_bubble")


def step_records(run_dir: str | Path) -> list[StepRecord]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; pass a run directory written by tailrace train or sim"
        )
    return [r for r in read_metrics(path) if isinstance(r, StepRecord)]


def step_figures(run_dir: str | Path, skip: int = 1) -> dict:
    """Means over the steps after the first `skip`: step time, its train part and the rest (rollout,
    weight sync, driver), per-step trainer waiting and bubble ratios, generated tokens/s, and DORA's
    length bubble (max - mean) / max."""
    steps = step_records(run_dir)
    use = steps[skip:] if len(steps) > skip else steps
    if not use:
        raise ValueError(f"{run_dir}: no step records")

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs)

    return {
        "steps": len(steps),
        "step_s": mean(r.time["step_s"] for r in use),
        "train_s": mean(r.time["train_s"] for r in use),
        "rollout_s": mean(r.time["step_s"] - r.time["train_s"] for r in use),
        "trainer_wait_ratio": mean(r.time["step_trainer_wait_ratio"] for r in use),
        "bubble_ratio": mean(r.time["step_bubble_ratio"] for r in use),
        "gen_tok_s": mean(r.time["gen_tok_s"] for r in use),
        "length_bubble": mean(r.length.get("bubble", 0.0) for r in use),
    }


def compare(real: dict, sim: dict) -> list[tuple[str, float, float, float]]:
    """(figure, real, simulated, relative error of the simulation)."""
    return [(k, real[k], sim[k], (sim[k] - real[k]) / real[k] if real[k] else float("nan")) for k in FIGURES]


def trainer_rate(run_dir: str | Path, cost, skip: int = 1) -> tuple[float, float]:
    """(seconds per step, FLOP/s) of the trainer as a run measured it: its train spans against the
    FLOPs `cost` charges for the same trajectories (from the journal and the train_issued marks).
    Separates what the machine delivered during the run from the simulator's composition of it."""
    import numpy as np

    run_dir = Path(run_dir)
    rows_of = trained_by_step(read_journal(run_dir / "journal.jsonl"), read_events(run_dir / "events.jsonl"))
    flops, secs = [], []
    for r in step_records(run_dir)[skip:]:
        rows = [p + n for p, n in rows_of.get(r.step, [])]
        if rows:
            flops.append(cost.train_flops(rows))
            secs.append(r.time["train_s"])
    f, t = np.array(flops), np.array(secs)
    w = 1.0 / t
    (a, inv), *_ = np.linalg.lstsq(np.stack([w, f * w], 1), np.ones_like(t), rcond=None)
    if a < 0 or inv <= 0:
        a, inv = 0.0, float(t.sum() / f.sum())
    return float(a), float(1.0 / inv)


def generate_busy_s(run_dir: str | Path) -> float:
    """Time the engines spent in generate spans (events.jsonl), summed over engines, inside the training
    window: from the first dispatched sample to the last trained step. A real run's held-out evaluations
    (before and after training) also generate on the engines; the simulator runs none."""
    spans, first, last = [], None, None
    for e in read_events(Path(run_dir) / "events.jsonl"):
        if isinstance(e, Span):
            if e.phase == "generate" and e.lane.startswith("engine"):
                spans.append((e.t0, e.t1))
        elif e.kind == "group_first_dispatch":
            first = e.t if first is None else min(first, e.t)
        elif e.kind == "trained":
            last = e.t if last is None else max(last, e.t)
    lo = first if first is not None else float("-inf")
    hi = last if last is not None else float("inf")
    return sum(max(0.0, min(t1, hi) - max(t0, lo)) for t0, t1 in spans)
