"""A run directory as a Chrome / Perfetto trace (the JSON trace-event format): open the file in
ui.perfetto.dev or chrome://tracing.

Tracks: one per engine (generate), the trainer (train), weight sync (the trainer's publishes and the
engines' loads), the scheduler's marks as instant events, and per train step its longest requests
(`tail 1` the longest, ...) from submission to finish, so the tail that set a round's makespan sits
under the engine that ran it. Times are the run's clock (seconds since training started), shown in
microseconds as the format wants.
"""

from __future__ import annotations

import json
from pathlib import Path

from tailrace.records import Finished, Mark, Span, read_events, read_journal

TAIL = 3  # longest requests shown per train step
_US = 1e6


def _event(name: str, track: str, t0: float, t1: float, cat: str, **args) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "pid": 1, "tid": track, "ts": t0 * _US,
            "dur": max(0.0, t1 - t0) * _US, "args": args}  # fmt: skip


def trace_events(run_dir: Path) -> list[dict]:
    events = list(read_events(run_dir / "events.jsonl"))
    out: list[dict] = []
    for e in events:
        if isinstance(e, Span):
            weights = e.phase in ("sync", "receive")  # a receive: a collective's, beside the engine's work
            track = "weight sync" if weights else e.lane
            name = f"{e.lane} {e.phase}" if weights else e.phase
            args = {k: v for k, v in (("version", e.version), ("step", e.step)) if v is not None}
            out.append(_event(name, track, e.t0, e.t1, e.phase, **args))
        else:
            out.append({"name": e.kind, "cat": "scheduler", "ph": "i", "s": "t", "pid": 1,
                        "tid": "scheduler", "ts": e.t * _US, "args": e.data})  # fmt: skip
    by_group: dict[int, list] = {}
    for j in read_journal(run_dir / "journal.jsonl"):
        if isinstance(j, Finished):
            by_group.setdefault(j.trajectory.group, []).append(j.trajectory)
    for m in events:
        if isinstance(m, Mark) and m.kind == "train_issued":
            trajs = [t for g in m.data["groups"] for t in by_group.get(g, ())]
            for rank, t in enumerate(sorted(trajs, key=lambda t: -t.length)[:TAIL], 1):
                r = t.result
                name = f"step {m.data['step']} group {t.group}.{t.sample_index}: {t.length} tokens"
                out.append(_event(name, f"tail {rank}", r.submitted, r.finished, "request",
                                  first_token=r.first_token, finish=r.finish.value))  # fmt: skip
    return out


def _with_track_ids(events: list[dict]) -> list[dict]:
    """Tracks named by string become numbered threads with a thread_name (what every viewer reads)."""
    order = ["trainer", "weight sync"]
    tracks = sorted(
        {e["tid"] for e in events}, key=lambda n: (n not in order, order.index(n) if n in order else 0, n)
    )
    ids = {name: i for i, name in enumerate(tracks)}
    meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": ids[n], "args": {"name": n}} for n in tracks]
    meta += [{"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": ids[n], "args": {"sort_index": ids[n]}}
             for n in tracks]  # fmt: skip
    return meta + [dict(e, tid=ids[e["tid"]]) for e in events]


def write_trace(run_dir: Path, out: Path | None = None) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / "events.jsonl").is_file():
        from tailrace.common import ConfigError

        raise ConfigError(
            f"{run_dir} has no events.jsonl; pass a run directory written by tailrace train or sim"
        )
    out = out or run_dir / "trace.json"
    out.write_text(
        json.dumps({"traceEvents": _with_track_ids(trace_events(run_dir)), "displayTimeUnit": "ms"})
    )
    return out
