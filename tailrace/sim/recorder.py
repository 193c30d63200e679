"""`Recorder`: what a simulated run leaves behind — the same run-directory files as a real run
(metrics.jsonl step records, events.jsonl spans and scheduler marks, journal.jsonl) and a summary of
the figures the published systems report.

The records are `tailrace.records`' (StepRecord via the same `metrics.step_record` as a real run,
Span, Mark, journal entries). The journal is optional (`journal=False`) because at scale it holds
every token id.
"""

from __future__ import annotations

from pathlib import Path

from tailrace.flow.commands import Train
from tailrace.metrics import step_record, utilization
from tailrace.records import Record, Span, StepRecord, dumps
from tailrace.sim.metrics import minus_length


class Recorder:
    def __init__(self, out_dir: str | Path | None = None, journal: bool = True) -> None:
        self.out = Path(out_dir) if out_dir is not None else None
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
        busy, slot_time = cl.trainer_busy, sum(e.slot_time_at(now) for e in cl.engines)
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
        s = cl.sched
        train = {"tokens": tokens, "sequences": len(trajs)}
        rec = step_record(
            c.step, s.done_version, trajs, c.trainer_version, s.ledger_record(), {}, train, timing,
            s.take_generated(),
        )  # fmt: skip
        self.steps.append(rec)
        self._write("metrics", rec)

    # ------------------------------------------------------------------ end of run
    def finish(self, cl) -> None:
        for e in cl.engines:
            for sp in e.spans:
                self._write("events", Span(f"engine{e.id}", sp.phase, sp.t0, sp.t1, sp.version))
        for sp in cl.trainer_spans:
            self._write("events", Span("trainer", sp.phase, sp.t0, sp.t1, sp.version))
        self.summary = self._summary(cl)
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

    def _summary(self, cl) -> dict:
        now = cl.now
        s = cl.sched
        steps = len(self.step_log)
        rounds = self.rounds()
        gen_spans = [(sp.t0, sp.t1) for e in cl.engines for sp in e.spans if sp.phase == "generate"]
        train_spans = [(sp.t0, sp.t1) for sp in cl.trainer_spans]
        last = self.steps[-1].time if self.steps else {}

        def mean(key):
            return sum(r[key] for r in rounds) / len(rounds) if rounds else float("nan")

        return {
            "policy": s.policy.name,
            "steps": steps,
            "rounds": len(rounds),
            "wall_s": now,
            "time_per_step_s": now / max(1, steps),
            "time_per_round_s": now / max(1, len(rounds)),
            "trainer_wait_ratio": last.get("trainer_wait_ratio", float("nan")),
            "bubble_ratio": last.get("bubble_ratio", float("nan")),
            "length_bubble": mean("length_bubble"),
            "window_s": mean("window_s"),
            "first_dispatch_s": mean("first_dispatch_s"),
            "rollout_only_share": minus_length(gen_spans, train_spans) / now if now else float("nan"),
            "gen_tokens": sum(e.gen_tokens for e in cl.engines),
            "preemptions": sum(e.preemptions for e in cl.engines),
            "spec_on_fraction": sum(e.spec_busy for e in cl.engines)
            / max(1e-12, sum(e.busy_time for e in cl.engines)),
            "recomputed_tokens": sum(e.recomputed_tokens for e in cl.engines),
            "gen_tok_s": sum(e.gen_tokens for e in cl.engines) / now if now else 0.0,
            "train_tokens": self.train_tokens,
            "sim_events": cl.events,
            "staleness": {str(k): v for k, v in sorted(s.staleness.items())},
            "ledger": s.ledger.state_dict(),
            "step_end_s": [r["end"] for r in sorted(self.step_log, key=lambda r: r["step"])],
            "failures": cl.failure_log.to_dict(),
        }
