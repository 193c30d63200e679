"""`Recorder`: what a simulated run leaves behind — the same run-directory files as a real run
(metrics.jsonl step records, events.jsonl spans and scheduler marks, journal.jsonl) and a summary of
the figures the published systems report.

The records are `tailrace.records`' (StepRecord via the same `metrics.step_record` as a real run,
Span, Mark, journal entries). The journal is optional (`journal=False`) because at scale it holds
every token id.

A recorder records one policy: with several in a run (`flow.multi.PolicySet`), each has its own, with
its own trainer's figures and its scheduler's marks, and the run's timeline (the engines' spans and
every trainer's, `write_timeline`) goes to the run's events.jsonl, as a real run of several policies
lays its files out. The engines are shared, so the engine figures of a policy's step records (bubble,
active batch, generated tokens) are every policy's, and an engine's sync span names the engines'
version (policy p's v is v * P + p). `run_summary` adds the run's totals.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterator

from tailrace.flow.commands import Train
from tailrace.metrics import step_record, utilization
from tailrace.records import Record, Span, StepRecord, dumps
from tailrace.sim.metrics import minus_length


class Recorder:
    def __init__(
        self, out_dir: str | Path | None = None, journal: bool = True, timeline: bool = True
    ) -> None:
        """`timeline`: its events.jsonl also gets the engines' and its trainer's spans (a run of one policy)."""
        self.out = Path(out_dir) if out_dir is not None else None
        self.timeline = timeline
        self._files = {}
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            names = ["metrics", "events"] + (["journal"] if journal else [])
            self._files = {n: open(self.out / f"{n}.jsonl", "w", buffering=1 << 16) for n in names}
        self.steps: list[StepRecord] = []
        self.first_dispatch: dict[int, float] = {}  # group -> time its first sample went out
        self.issued: dict[int, tuple[float, Train]] = {}  # step -> (time issued, command)
        self.step_log: list[dict] = []  # per finished step: groups, times, publish, lengths
        self._prev = (0.0, 0.0, 0.0, 0, 0)  # (t, trainer busy, slot time, gen tokens, train tokens)
        self.train_tokens = 0

    def _write(self, name: str, rec: Record) -> None:
        f = self._files.get(name)
        if f is not None:
            f.write(dumps(rec) + "\n")

    # ------------------------------------------------------------------ scheduler side
    def record(self, out) -> None:
        """A poll's journal entries and marks (its `Outbox`)."""
        for e in out.journal:
            self._write("journal", e)
        for m in out.marks:
            if m.kind == "group_first_dispatch":
                self.first_dispatch.setdefault(m.data["group"], m.t)
            self._write("events", m)

    def on_train_issued(self, c: Train, now: float) -> None:
        self.issued[c.step] = (now, c)

    def on_trained(self, cl, c: Train, tokens: int, span: tuple[float, float], sync) -> None:
        now = cl.now
        issued_at, _ = self.issued.pop(c.step)
        trajs = [t for g in c.groups for t in g.trajectories]
        self.train_tokens += tokens
        self.step_log.append(
            {
                "step": c.step,
                "groups": [g.id for g in c.groups],
                "issued": issued_at,
                "t0": span[0],
                "end": now,
                "publish": c.publish,
                "lengths": [t.length for t in trajs],
            }
        )
        slots = sum(e.slots for e in cl.engines)
        busy, slot_time = cl.trainers[c.policy].busy, sum(e.slot_time_at(now) for e in cl.engines)
        gen = sum(e.gen_tokens for e in cl.engines)
        engine_busy = sum(e.busy_time_at(now) for e in cl.engines)
        cur = (now, busy, slot_time, gen, self.train_tokens)
        timing = utilization(0.0, cur, self._prev, slots, engine_busy)
        self._prev = cur
        timing.update(
            {
                "train_s": span[1] - span[0],
                "weight_sync_s": (sync[1] - sync[0]) if sync else 0.0,
                "trainer_step_s": span[1] - span[0],
            }
        )
        s = cl.policies[c.policy]
        train = {"tokens": tokens, "sequences": len(trajs)}
        rec = step_record(
            c.step, s.done_version, trajs, c.trainer_version, s.ledger_record(), {}, train, timing,
            s.take_generated(),
        )  # fmt: skip
        self.steps.append(rec)
        self._write("metrics", rec)

    # ------------------------------------------------------------------ end of run
    def finish(self, cl, p: int) -> None:
        """The run ended: the timeline (if it keeps one) and policy p's summary."""
        if self.timeline:
            for sp in _timeline(cl, {p: "trainer"}):
                self._write("events", sp)
        self.summary = self._summary(cl, p)
        for f in self._files.values():
            f.close()
        self._files = {}

    def rounds(self) -> list[dict]:
        """Optimizer steps grouped into rounds: a round ends with the step that publishes weights."""
        out, cur = [], []
        for s in sorted(self.step_log, key=lambda s: s["step"]):
            cur.append(s)
            if s["publish"] is not None:
                out.append(cur)
                cur = []
        if cur:
            out.append(cur)
        res = []
        for steps in out:
            groups = [g for s in steps for g in s["groups"]]
            start = min(self.first_dispatch.get(g, steps[0]["issued"]) for g in groups)
            lens = [n for s in steps for n in s["lengths"]]
            mx = max(lens)
            res.append(
                {
                    "start": start,
                    "end": steps[-1]["end"],
                    "window_s": steps[-1]["end"] - start,
                    "first_dispatch_s": min(s["issued"] for s in steps) - start,
                    "length_bubble": (mx - sum(lens) / len(lens)) / mx,
                    "steps": len(steps),
                }
            )
        return res

    def _summary(self, cl, p: int) -> dict:
        """Policy p's figures; its wall time is when it finished (its last step's end)."""
        s = cl.policies[p]
        steps = len(self.step_log)
        end = max(r["end"] for r in self.step_log) if s.done and self.step_log else cl.now
        rounds = self.rounds()
        last = self.steps[-1].time if self.steps else {}
        return {
            "policy": s.policy.name,
            "steps": steps,
            "rounds": len(rounds),
            "wall_s": end,
            "time_per_step_s": end / max(1, steps),
            "time_per_round_s": end / max(1, len(rounds)),
            "trainer_wait_ratio": last.get("trainer_wait_ratio", float("nan")),
            "bubble_ratio": last.get("bubble_ratio", float("nan")),
            **_round_means(rounds),
            "train_tokens": self.train_tokens,
            "staleness": {str(k): v for k, v in sorted(s.staleness.items())},
            "ledger": s.ledger.state_dict(),
            "step_end_s": [r["end"] for r in sorted(self.step_log, key=lambda r: r["step"])],
        }


def _timeline(cl, lanes: dict[int, str]) -> Iterator[Span]:
    """The engines' spans, then those of the trainers of `lanes` (policy -> its lane)."""
    for e in cl.engines:
        for sp in e.spans:
            yield Span(f"engine{e.id}", sp.phase, sp.t0, sp.t1, sp.version)
    for p, lane in lanes.items():
        for sp in cl.trainers[p].spans:
            yield Span(lane, sp.phase, sp.t0, sp.t1, sp.version)


def write_timeline(cl, path: Path, lanes: list[str]) -> None:
    """A run of several policies' own events.jsonl: the engines' spans and every trainer's, in its
    lane (policy p's: lanes[p])."""
    with open(path, "w") as f:
        for sp in _timeline(cl, dict(enumerate(lanes))):
            f.write(dumps(sp) + "\n")


def _round_means(rounds: list[dict]) -> dict:
    def mean(key):
        return sum(r[key] for r in rounds) / len(rounds) if rounds else float("nan")

    return {k: mean(k) for k in ("length_bubble", "window_s", "first_dispatch_s")}


def run_summary(cl) -> dict:
    """The run's summary: the policy's figures and the engines' (one policy); or the run's totals, the
    engines' figures and each policy's own under `policies` (several)."""
    figures = [r.summary for r in cl.recs]
    now = cl.now
    gen_spans = [(sp.t0, sp.t1) for e in cl.engines for sp in e.spans if sp.phase == "generate"]
    train_spans = [(sp.t0, sp.t1) for tr in cl.trainers for sp in tr.spans]
    gen = sum(e.gen_tokens for e in cl.engines)
    engines = {
        "rollout_only_share": minus_length(gen_spans, train_spans) / now if now else float("nan"),
        "gen_tokens": gen,
        "preemptions": sum(e.preemptions for e in cl.engines),
        "spec_on_fraction": sum(e.spec_busy for e in cl.engines)
        / max(1e-12, sum(e.busy_time for e in cl.engines)),
        "recomputed_tokens": sum(e.recomputed_tokens for e in cl.engines),
        "gen_tok_s": gen / now if now else 0.0,
        "sim_events": cl.events,
        "failures": cl.failure_log.to_dict(),
    }
    if len(figures) == 1:
        return {**figures[0], **engines}
    steps, rounds = sum(f["steps"] for f in figures), sum(f["rounds"] for f in figures)
    busy = sum(tr.busy for tr in cl.trainers)
    slot_time = sum(e.slot_time_at(now) for e in cl.engines)
    staleness, discarded = Counter(), Counter()
    for f in figures:
        staleness.update(f["staleness"])
        discarded.update(f["ledger"]["discarded"])
    totals = {
        "policy": "+".join(f["policy"] for f in figures),
        "steps": steps,
        "rounds": rounds,
        "wall_s": now,
        "time_per_step_s": now / max(1, steps),
        "time_per_round_s": now / max(1, rounds),
        "trainer_wait_ratio": 1.0 - min(1.0, busy / (len(figures) * now)) if now else float("nan"),
        "bubble_ratio": 1.0 - min(1.0, slot_time / (sum(e.slots for e in cl.engines) * now))
        if now
        else float("nan"),
        **_round_means([r for rec in cl.recs for r in rec.rounds()]),
        "train_tokens": sum(f["train_tokens"] for f in figures),
        "staleness": {k: staleness[k] for k in sorted(staleness, key=int)},
        "ledger": {
            "produced": sum(f["ledger"]["produced"] for f in figures),
            "trained": sum(f["ledger"]["trained"] for f in figures),
            "discarded": dict(discarded),
        },
    }
    return {**totals, **engines, "policies": dict(zip(cl.policies.names, figures))}
