"""report.html for a run directory: timeline (Gantt: one lane per engine and one for the trainer,
coloured by phase), reward and accuracy curves, response-length histograms per step, staleness, the
workers recovered while it ran, and the run's configuration. Figures are matplotlib PNGs embedded
inline, so the file stands alone."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tailrace.records import (  # noqa: E402
    CheckpointRecord,
    EvalRecord,
    JournalEntry,
    Mark,
    Span,
    StepRecord,
    generated_lengths,
    read_events,
    read_journal,
    read_metrics,
    trained_by_step,
)
from tailrace.runtime.evaluate import difficulty_line  # noqa: E402

PHASE_COLORS = {
    "generate": "#4c78a8", "train": "#f58518", "sync": "#54a24b", "wait": "#dddddd",
    "replay": "#e45756",  # a replacement trainer redoing the steps since its checkpoint
    "tool": "#b279a2",  # a tool call running in the driver's pool (multi-turn tasks)
}  # fmt: skip


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "<img src='data:image/png;base64," + base64.b64encode(buf.getvalue()).decode() + "'/>"


def gantt(ax, events: list[Span | Mark], title: str = "") -> None:
    """Draw one run's spans: a lane per engine/trainer, bars coloured by phase."""
    spans = [e for e in events if isinstance(e, Span)]
    lanes = sorted({e.lane for e in spans}, key=lambda n: (n != "trainer", n))
    for y, lane in enumerate(lanes):
        for phase in PHASE_COLORS:
            bars = [(e.t0, e.t1 - e.t0) for e in spans if e.lane == lane and e.phase == phase]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), color=PHASE_COLORS[phase], label=phase)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=7)


def timeline_figure(events: list[Span | Mark], title: str = "timeline") -> str:
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.5 * len({e.lane for e in events if isinstance(e, Span)})))
    gantt(ax, events, title)
    return _png(fig)


def curves_figure(steps: list[StepRecord], evals: list[EvalRecord]) -> str:
    fig, ax = plt.subplots(1, 2, figsize=(12, 3.2))
    x = [s.step + 1 for s in steps]
    ax[0].plot(x, [s.reward for s in steps], label="train reward")
    ax[0].plot(x, [s.accuracy for s in steps], label="train accuracy", alpha=0.7)
    for name in dict.fromkeys(k for s in steps for k in s.rewards):  # a list of reward functions: each one's
        got = [(s.step + 1, s.rewards[name]) for s in steps if name in s.rewards]
        ax[0].plot(*zip(*got), linestyle="--", alpha=0.7, label=f"reward: {name}")
    for e in evals:
        ax[0].scatter([e.step], [e.accuracy], marker="*", s=120, zorder=3, label=f"held-out ({e.tag})")
    ax[0].set_xlabel("step")
    ax[0].legend(fontsize=7)
    L = [s.length for s in steps]
    for key in ("p50", "p90", "max"):
        ax[1].plot(x, [d.get(key, 0) for d in L], label=f"length {key}")
    ax[1].set_xlabel("step")
    ax[1].legend(fontsize=7)
    return _png(fig)


def lengths_figure(journal: list[JournalEntry], events: list[Span | Mark]) -> str:
    """Left: response-length histograms of the samples trained at a few steps (first, middle, last).
    Right: over the whole run, every length generated (finished) against the ones trained — they
    differ when shaping selected (darts, tailbatch) or groups were dropped."""
    by_step = {s: [n for _, n in rows] for s, rows in trained_by_step(journal, events).items()}
    fig, ax = plt.subplots(1, 2, figsize=(12, 3))
    if by_step:
        order = sorted(by_step)
        for step in sorted({order[0], order[len(order) // 2], order[-1]}):
            if by_step[step]:
                ax[0].hist(by_step[step], bins=30, alpha=0.5, label=f"step {step + 1}")
        generated, trained = generated_lengths(journal), [n for lens in by_step.values() for n in lens]
        if generated and trained:
            ax[1].hist(generated, bins=30, alpha=0.5, label=f"generated ({len(generated)})")
            ax[1].hist(trained, bins=30, alpha=0.5, label=f"trained ({len(trained)})")
    ax[0].set_xlabel("response length (tokens), trained at a step")
    ax[1].set_xlabel("response length (tokens), whole run")
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=7)
    return _png(fig)


def _checkpoints(saved: list[CheckpointRecord]) -> str:
    if not saved:
        return ""
    last, mean_s = saved[-1], sum(c.seconds for c in saved) / len(saved)
    b = last.bytes
    return (
        f"<p>{len(saved)} checkpoints, the last after step {last.step}: {b['total'] / 1e6:.1f} MB (model "
        f"{b['model'] / 1e6:.1f} MB, optimizer {b['optimizer'] / 1e6:.1f} MB); the trainer spent {mean_s:.2f} s "
        "writing each</p>"
    )


def _recoveries(events: list[Span | Mark]) -> str:
    """A row per worker replaced while the run went (`recovery` marks: runtime/recovery.py)."""
    marks = [e for e in events if isinstance(e, Mark) and e.kind == "recovery"]
    if not marks:
        return ""
    rows = "".join(
        f"<tr><td>{m.t:.1f}</td><td>{html.escape(m.data['worker'])}</td><td>{html.escape(m.data['cause'])}</td>"
        f"<td>{m.data['downtime_s']:.1f}</td><td>{m.data['requeued']}</td><td>{m.data['replayed']}</td>"
        f"<td style='text-align:left'>{html.escape(m.data['detail'])}</td></tr>"
        for m in marks
    )
    down = sum(m.data["downtime_s"] for m in marks)
    return (
        f"<h2>Recoveries</h2><p>{len(marks)} workers replaced, {down:.1f} s down in all</p><table>"
        "<tr><th>at (s)</th><th>worker</th><th>cause</th><th>down (s)</th><th>samples requeued</th>"
        f"<th>steps replayed</th><th>what happened</th></tr>{rows}</table>"
    )


def _tools(steps: list[StepRecord]) -> str:
    """A multi-turn run's tool use and tool waiting per step (the third source of tail)."""
    steps = [r for r in steps if r.tools]
    if not steps:
        return ""
    rows = "".join(
        f"<tr><td>{r.step + 1}</td><td>{r.tools['calls']}</td><td>{r.tools['turns_mean']:.2f}</td>"
        f"<td>{r.tools['calling']:.2f}</td><td>{r.tools['errors']}</td><td>{r.time.get('tool_wait_s', 0):.2f}</td>"
        f"<td>{r.time.get('tool_wait_max_s', 0):.3f}</td><td>{r.time.get('step_s', 0):.2f}</td></tr>"
        for r in steps
    )
    return (
        "<h2>Tools</h2><p>Samples parked at a tool hold no engine slot; a step's tool wait is the "
        "seconds its trajectories spent parked (summed; the most one trajectory waited).</p><table>"
        "<tr><th>step</th><th>calls</th><th>turns/traj</th><th>calling</th><th>failed</th>"
        f"<th>tool wait s</th><th>max s</th><th>step s</th></tr>{rows}</table>"
    )


def _routing(steps: list[StepRecord]) -> str:
    """A mixture of experts' routing in each step's forwards (`train.moe_load_max`, `train.moe_idle`; with
    routing replay `train.moe_route_flips` and `train.routes_replayed`): at most 20 rows, evenly spaced."""
    steps = [r for r in steps if isinstance(r.train, dict) and "moe_load_max" in r.train]
    if not steps:
        return ""
    replay = any("routes_replayed" in r.train for r in steps)

    def cells(t: dict) -> str:
        out = f"<td>{t['moe_load_max']:.2f}</td><td>{t['moe_idle']:.1%}</td>"
        if replay:
            out += f"<td>{t.get('routes_replayed', 0.0):.1%}</td><td>{t.get('moe_route_flips', 0.0):.3%}</td>"
        return out

    rows = "".join(
        f"<tr><td>{r.step + 1}</td>{cells(r.train)}</tr>" for r in steps[:: max(1, len(steps) // 20)]
    )
    more = "<th>tokens replayed</th><th>replayed routes the trainer would not pick</th>" if replay else ""
    note = (
        " Routing replay: the share of sampled tokens whose experts came from the engine, and of the replayed "
        "(position, layer)s those whose experts the trainer's own router would not have chosen (each a "
        "logprob gap it no longer has)."
        if replay
        else ""
    )
    return (
        "<h2>Routing</h2><p>The tokens each expert took in a step's forwards, per layer, averaged over the "
        "layers: the busiest expert's share over an even one's (1: even; a router collapsing onto a few "
        f"experts climbs), and the experts no token reached.{note}</p><table>"
        f"<tr><th>step</th><th>busiest / even</th><th>idle experts</th>{more}</tr>{rows}</table>"
    )


def write_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        from tailrace.common import ConfigError

        raise ConfigError(f"{run_dir} has no metrics.jsonl; pass a run directory written by tailrace train")
    metrics = list(read_metrics(run_dir / "metrics.jsonl"))
    steps = [m for m in metrics if isinstance(m, StepRecord)]
    evals = [m for m in metrics if isinstance(m, EvalRecord)]
    saved = [m for m in metrics if isinstance(m, CheckpointRecord)]
    events = list(read_events(run_dir / "events.jsonl"))
    journal = list(read_journal(run_dir / "journal.jsonl"))
    last = steps[-1] if steps else None
    rows = "".join(
        f"<tr><td>{html.escape(e.tag)}</td><td>{e.step}</td><td>{e.accuracy:.3f}</td>"
        f"<td>{e.summary['p50']:.0f}</td><td>{e.summary['p99']:.0f}</td><td>{e.summary['max']}</td>"
        f"<td style='text-align:left'>{html.escape(difficulty_line(e.summary))}</td></tr>"
        for e in evals
    )
    t = last.time if last else {}
    ledger = last.ledger if last else {}
    config = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").is_file() else ""
    body = f"""<html><head><meta charset='utf-8'><title>tailrace run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{padding:2px 10px;text-align:right}}</style></head><body>
<h1>tailrace run {html.escape(run_dir.name)}</h1>
<p>{len(steps)} steps, wall {t.get("wall_s", 0):.1f} s, trainer waiting ratio {t.get("trainer_wait_ratio", 0):.2f},
rollout bubble ratio {t.get("bubble_ratio", 0):.2f}, ledger {json.dumps(ledger)}</p>
{_checkpoints(saved)}
{_recoveries(events)}
{_tools(steps)}
{_routing(steps)}
<h2>Held-out evaluation</h2><table>
<tr><th>when</th><th>step</th><th>accuracy</th><th>p50</th><th>p99</th><th>max</th>
<th>by difficulty</th></tr>{rows}</table>
<h2>Reward, accuracy, lengths</h2>{curves_figure(steps, evals) if steps else ""}
<h2>Timeline</h2>{timeline_figure(events)}
<h2>Response lengths</h2>{lengths_figure(journal, events)}
<h2>Configuration</h2><pre>{html.escape(config)}</pre>
</body></html>"""
    out = run_dir / "report.html"
    out.write_text(body)
    return out
