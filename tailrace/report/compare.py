"""One page comparing runs: `tailrace report RUN_A RUN_B ...` (and bench/modes.py for its runs).

Per run, on shared axes: held-out accuracy against wall time (the time each evaluated version was
published, so evaluation cost is not on the clock) and against steps; the training batch's reward;
the step time broken into training and the rest; trainer waiting and rollout bubble ratios; the
staleness of the trained samples; and the response-length distribution. A table gives the figures
a user compares runs by: final accuracy, wall time, steps per hour, and the wall time to reach a
target accuracy (by default the lowest final accuracy among the runs minus 2 points).

A policy that joined a running run (`tailrace policy join`) keeps its records on its own clock, from
its join: the accuracy-against-time plot moves it to the run's clock (the `policy_join` event in the
run's events.jsonl says where its clock starts), and the table gives the time it joined; its wall time
and time to target stay its own.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt

from tailrace.common import ConfigError
from tailrace.metrics import time_to_accuracy
from tailrace.records import EvalRecord, Finished, Mark, StepRecord, read_events, read_journal, read_metrics
from tailrace.report.html import _png


@dataclass
class Run:
    name: str
    steps: list[StepRecord]
    evals: list[EvalRecord]
    lengths: list[int]
    joined_s: float = 0.0  # where its clock starts on the run's (a policy that joined the run)

    @classmethod
    def read(cls, path: Path) -> Run:
        if not (path / "metrics.jsonl").is_file():
            raise ConfigError(f"{path} has no metrics.jsonl; pass run directories written by tailrace train")
        metrics = list(read_metrics(path / "metrics.jsonl"))
        lengths = [
            e.trajectory.length for e in read_journal(path / "journal.jsonl") if isinstance(e, Finished)
        ]
        return cls(
            path.name,
            [m for m in metrics if isinstance(m, StepRecord)],
            sorted((m for m in metrics if isinstance(m, EvalRecord)), key=lambda e: e.step),
            lengths,
            joined_at(path),
        )

    @property
    def wall_s(self) -> float:
        return self.steps[-1].time["wall_s"] if self.steps else 0.0

    @property
    def final_accuracy(self) -> float | None:
        """The final evaluation's (a checkpoint's record of the same step may follow it)."""
        if not self.evals:
            return None
        final = [e for e in self.evals if e.tag == "final"]
        return (final or self.evals)[-1].accuracy

    def time_to(self, target: float) -> float | None:
        return time_to_accuracy([(e.wall_s, e.accuracy) for e in self.evals], target)


def joined_at(path: Path) -> float:
    """When the policy whose directory is `path` (RUN/policies/NAME) joined its run, on the run's clock;
    0 for a run's own policies and for a plain run."""
    events = path.parent.parent / "events.jsonl"
    if path.parent.name != "policies" or not events.is_file():
        return 0.0
    for m in read_events(events):
        if isinstance(m, Mark) and m.kind == "policy_join" and m.data.get("policy") == path.name:
            return float(m.data.get("clock_s", m.t))
    return 0.0


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def curves(runs: list[Run]) -> str:
    fig, ax = plt.subplots(1, 3, figsize=(15, 3.6))
    for r in runs:
        label = f"{r.name} (joined at {r.joined_s:.0f} s)" if r.joined_s else r.name
        (line,) = ax[0].plot(
            [r.joined_s + e.wall_s for e in r.evals], [e.accuracy for e in r.evals], marker="o", label=label
        )
        ax[1].plot(
            [e.step for e in r.evals], [e.accuracy for e in r.evals], marker="o", color=line.get_color()
        )
        ax[2].plot(
            [s.step + 1 for s in r.steps], [s.reward for s in r.steps], color=line.get_color(), alpha=0.7
        )
    for a, x, y in zip(ax, ("run's wall s (publication of the evaluated version)", "step", "step"),
                       ("held-out accuracy", "held-out accuracy", "training-batch reward")):  # fmt: skip
        a.set_xlabel(x)
        a.set_ylabel(y)
    ax[0].legend(fontsize=7)
    return _png(fig)


def breakdown(runs: list[Run]) -> str:
    fig, ax = plt.subplots(1, 4, figsize=(16, 3.4))
    names = [r.name for r in runs]
    train = [_mean([s.time["train_s"] for s in r.steps]) for r in runs]
    step = [_mean([s.time["step_s"] for s in r.steps]) for r in runs]
    ax[0].bar(names, train, label="train")
    ax[0].bar(
        names, [max(0.0, a - b) for a, b in zip(step, train)], bottom=train, label="rest (rollout, sync)"
    )
    ax[0].set_ylabel("s per step")
    ax[0].legend(fontsize=7)
    for a, key, title in (
        (ax[1], "trainer_wait_ratio", "trainer waiting"),
        (ax[2], "bubble_ratio", "bubble"),
    ):
        a.bar(names, [r.steps[-1].time[key] if r.steps else 0.0 for r in runs])
        a.set_title(title)
    for r in runs:
        stale: dict[int, int] = {}
        for s in r.steps:
            for k, v in s.staleness.items():
                stale[int(k)] = stale.get(int(k), 0) + v
        total = sum(stale.values()) or 1
        ax[3].plot(sorted(stale), [stale[k] / total for k in sorted(stale)], marker="o", label=r.name)
    ax[3].set_xlabel("staleness (versions)")
    ax[3].set_title("trained samples")
    for a in ax[:3]:
        a.tick_params(axis="x", labelrotation=30, labelsize=7)
    return _png(fig)


def lengths(runs: list[Run]) -> str:
    fig, ax = plt.subplots(figsize=(12, 3))
    top = max((max(r.lengths) for r in runs if r.lengths), default=1)
    for r in runs:
        if r.lengths:
            ax.hist(r.lengths, bins=40, range=(0, top), alpha=0.45, density=True, label=r.name)
    ax.set_xlabel("response length (tokens), every finished sample")
    ax.legend(fontsize=7)
    return _png(fig)


def table(runs: list[Run], target: float) -> str:
    def cell(x, fmt):
        return "-" if x is None else format(x, fmt)

    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td>{r.joined_s:.1f}</td><td>{len(r.steps)}</td><td>{r.wall_s:.1f}</td>"
        f"<td>{len(r.steps) / r.wall_s * 3600 if r.wall_s else 0:.0f}</td>"
        f"<td>{cell(r.final_accuracy, '.3f')}</td><td>{cell(r.time_to(target), '.1f')}</td></tr>"
        for r in runs
    )
    return (
        "<table><tr><th>run</th><th>joined at s</th><th>steps</th><th>wall s</th><th>steps/h</th>"
        "<th>final accuracy</th>"
        f"<th>s to {target:.3f}</th></tr>{rows}</table>"
    )


def write_comparison(run_dirs: list[Path], out: Path, target: float | None = None) -> Path:
    runs = [Run.read(Path(p)) for p in run_dirs]
    finals = [r.final_accuracy for r in runs if r.final_accuracy is not None]
    if target is None:
        target = min(finals) - 0.02 if finals else 1.0
    n = max((e.summary.get("n", 0) for r in runs for e in r.evals), default=0)
    body = f"""<html><head><meta charset='utf-8'><title>tailrace: {len(runs)} runs</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{padding:2px 10px;text-align:right}}</style></head><body>
<h1>{len(runs)} runs compared</h1>
<p>Target accuracy {target:.3f} (lowest final accuracy minus 2 points unless given); held-out sets of
{n} prompts: one evaluation's standard error is at most {100 * (0.25 / max(n, 1)) ** 0.5:.1f} points.</p>
{table(runs, target)}
<h2>Held-out accuracy and reward</h2>{curves(runs)}
<h2>Where the time goes</h2>{breakdown(runs)}
<h2>Response lengths</h2>{lengths(runs)}
</body></html>"""
    out.write_text(body)
    return out
