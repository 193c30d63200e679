"""The run directory's records, and their one serializer. Torch-free: the runtime, the simulator, the
scheduler (its journal), resume, the report, `sim/compare` and `tailrace trace` all use these.

    metrics.jsonl   StepRecord (kind "step"), EvalRecord ("eval"), CheckpointRecord ("checkpoint")
    events.jsonl    Span (a component busy in a phase) and Mark (a scheduler event)
    journal.jsonl   Opened / Finished / Discarded / Dropped: the scheduler's write-ahead log

Token ids and logprobs of a trajectory are stored as base64 of packed little-endian arrays (ids in
the narrowest unsigned width that holds them, logprobs as float32 when that is exact, else float64),
and per-token versions as (version, count) runs: every value round-trips exactly, at a fraction of
the bytes of JSON numbers. Each record stays one JSON line, so a torn last line is the only damage a
crash can do.
"""

from __future__ import annotations

import base64
import json
import sys
import warnings
from array import array
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from tailrace.common import InputError
from tailrace.types import Finish, GenResult, Prompt, Trajectory

# -- packed arrays ------------------------------------------------------------------------------


def _pack(a: array) -> str:
    if sys.byteorder == "big":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


def _unpack(code: str, s: str) -> list:
    a = array(code)
    a.frombytes(base64.b64decode(s))
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def _pack_ids(ids) -> tuple[str, str]:
    top = max(ids, default=0)
    code = "B" if top < 1 << 8 else "H" if top < 1 << 16 else "I"
    return code, _pack(array(code, ids))


def _pack_floats(xs) -> tuple[str, str]:
    xs = list(xs)
    f32 = array("f", xs)
    return ("f", _pack(f32)) if f32.tolist() == xs else ("d", _pack(array("d", xs)))


def _runs(xs) -> list[list[int]]:
    return [[v, sum(1 for _ in g)] for v, g in groupby(xs)]


def _expand(runs: list[list[int]]) -> tuple[int, ...]:
    return tuple(v for v, n in runs for _ in range(n))


# -- prompts and trajectories ---------------------------------------------------------------------


def prompt_to_json(p: Prompt) -> dict:
    return {"id": p.id, "token_ids": list(p.token_ids), "answer": p.answer, "text": p.text}


def prompt_from_json(d: dict) -> Prompt:
    return Prompt(id=d["id"], token_ids=tuple(d["token_ids"]), answer=d["answer"], text=d["text"])


def trajectory_to_json(t: Trajectory) -> dict:
    """Everything but the prompt's token ids (the group's prompt holds them) and the routes an MoE's
    engine recorded (a position's k experts in each layer: 384 bytes a token for Qwen3-30B-A3B, so a
    trajectory read back from the journal is routed afresh by the trainer)."""
    r = t.result
    id_code, ids = _pack_ids(r.token_ids)
    lp_code, lps = _pack_floats(r.logprobs)
    return {
        "group": t.group, "index": t.sample_index, "prompt_id": t.prompt_id, "request_id": r.request_id,
        "reward": t.reward, "correct": t.correct, "version": t.dispatch_version, "finish": r.finish.value,
        "times": [r.submitted, r.first_token, r.finished], "n": len(r.token_ids),
        "ids": [id_code, ids], "logprobs": [lp_code, lps], "versions": _runs(r.versions),
        **({"observed": [list(s) for s in t.observed], "tool_s": t.tool_s} if t.observed else {}),
    }  # fmt: skip


def trajectory_from_json(d: dict, prompt_ids: tuple[int, ...]) -> Trajectory:
    submitted, first, finished = d["times"]
    result = GenResult(
        d["request_id"], tuple(_unpack(*d["ids"])), tuple(_unpack(*d["logprobs"])),
        _expand(d["versions"]), Finish(d["finish"]), submitted, first, finished,
    )  # fmt: skip
    return Trajectory(
        group=d["group"], sample_index=d["index"], prompt_id=d["prompt_id"], prompt_ids=prompt_ids,
        result=result, reward=d["reward"], correct=d["correct"], dispatch_version=d["version"],
        observed=tuple((int(a), int(b)) for a, b in d.get("observed", ())), tool_s=d.get("tool_s", 0.0),
    )  # fmt: skip


# -- the journal --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Opened:
    """A group was opened at `version` on `prompt` (taken fresh from the stream, or requeued)."""

    group: int
    version: int
    prompts_taken: int  # prompts taken from the stream so far, this one included if fresh
    requeued: bool
    prompt: Prompt
    candidates: int = 0  # samples shaping planned for the prompt (0 = the group size)
    early_stop: bool = False  # shaping stops the group at its first group-size finishers
    own: bool = False  # the prompt came from shaping's own queue (tailbatch, sorted), not the stream
    external: bool = False  # an external agent's group (flow/external.py): its samples follow, whole
    kind = "open"

    def to_json(self) -> dict:
        return {
            "kind": self.kind, "group": self.group, "version": self.version,
            "prompts_taken": self.prompts_taken, "requeued": self.requeued,
            "prompt": prompt_to_json(self.prompt), "candidates": self.candidates,
            "early_stop": self.early_stop, "own": self.own, **({"external": True} if self.external else {}),
        }  # fmt: skip


@dataclass(frozen=True)
class Finished:
    """A sample finished (stopped or truncated) and joined its group in the store."""

    trajectory: Trajectory
    kind = "done"

    def to_json(self) -> dict:
        return {"kind": self.kind, **trajectory_to_json(self.trajectory)}


@dataclass(frozen=True)
class Discarded:
    """A sample left for good without being trained (an aborted partial not resumed, ...)."""

    group: int
    index: int
    reason: str
    kind = "discard"

    def to_json(self) -> dict:
        return {"kind": self.kind, "group": self.group, "index": self.index, "reason": self.reason}


@dataclass(frozen=True)
class Dropped:
    """A complete group left without being trained (`reason`: zero-signal, ...); its samples are
    discarded with that reason."""

    group: int
    reason: str
    kind = "drop"

    def to_json(self) -> dict:
        return {"kind": self.kind, "group": self.group, "reason": self.reason}


@dataclass(frozen=True)
class Deferred:
    """Shaping gave an open (or just completed) group up (tailbatch: it missed its round's cut); its
    prompt joins the tail queue, its samples are discarded (reason `shaping`) once none is in flight."""

    group: int
    kind = "defer"

    def to_json(self) -> dict:
        return {"kind": self.kind, "group": self.group}


JournalEntry = Opened | Finished | Discarded | Dropped | Deferred


def journal_from_json(d: dict) -> JournalEntry:
    """Decode one journal line. A Finished trajectory comes without its prompt's token ids (`()`):
    the Opened entry of its group holds them."""
    kind = d["kind"]
    if kind == "open":
        return Opened(
            d["group"], d["version"], d["prompts_taken"], d["requeued"], prompt_from_json(d["prompt"]),
            d.get("candidates", 0), d.get("early_stop", False), d.get("own", False), d.get("external", False),
        )  # fmt: skip
    if kind == "done":
        return Finished(trajectory_from_json(d, ()))
    if kind == "discard":
        return Discarded(d["group"], d["index"], d["reason"])
    if kind == "drop":
        return Dropped(d["group"], d["reason"])
    if kind == "defer":
        return Deferred(d["group"])
    raise ValueError(f"unknown journal entry kind {kind!r}")


# -- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A component (`lane`: engine0, trainer, ...) busy in `phase` (generate, train, sync, wait, ...)."""

    lane: str
    phase: str
    t0: float
    t1: float
    version: int | None = None
    step: int | None = None

    def to_json(self) -> dict:
        d = {"lane": self.lane, "phase": self.phase, "t0": self.t0, "t1": self.t1}
        if self.version is not None:
            d["version"] = self.version
        if self.step is not None:
            d["step"] = self.step
        return d


@dataclass(frozen=True)
class Mark:
    """A time-stamped scheduler event (round start, group ready, train issued, ...)."""

    t: float
    kind: str
    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"lane": "scheduler", "kind": self.kind, "t": self.t, **self.data}


def event_from_json(d: dict) -> Span | Mark:
    if "phase" in d:
        return Span(d["lane"], d["phase"], d["t0"], d["t1"], d.get("version"), d.get("step"))
    data = {k: v for k, v in d.items() if k not in ("lane", "kind", "t")}
    return Mark(d["t"], d["kind"], data)


# -- metrics ------------------------------------------------------------------------------------


OPTIONAL = ("tools", "rewards")  # a step record's fields written only where not empty


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step. Deterministic figures at the top level; everything that depends on wall
    time under `time` (so two seeded sync runs give equal records but for `time`)."""

    step: int
    version: int  # trainer version after the step
    reward: float
    accuracy: float  # fraction of the step's samples the task scored correct
    samples: int
    length: dict[str, float]  # metrics.length_stats
    staleness: dict[str, int]  # trainer version - oldest token version -> samples
    discards: dict[str, int]  # reason -> samples, cumulative
    ledger: dict[str, Any]  # produced, trained, discarded, in_store (cumulative)
    reward_errors: dict[str, int]
    train: dict[str, float]  # the trainer's step metrics
    time: dict[str, float]  # metrics.utilization + train_s, weight_sync_s, ...
    # multi-turn runs (metrics.tool_stats): tool calls, turns, observation tokens, failed calls;
    # the waits are under `time` (tool_wait_s, tool_wait_max_s, tool_run_s). Empty otherwise.
    tools: dict[str, float] = field(default_factory=dict)
    # a list of reward functions (task.reward): each one's mean over the responses scored for training
    # since the previous step's record, by name. Empty otherwise.
    rewards: dict[str, float] = field(default_factory=dict)
    kind = "step"

    def to_json(self) -> dict:
        keys = [k for k in self.__dataclass_fields__ if k not in OPTIONAL or getattr(self, k)]
        return {"kind": self.kind, **{k: getattr(self, k) for k in keys}}


@dataclass(frozen=True)
class EvalRecord:
    """Held-out accuracy and response lengths of the weights `version` (`tag`: base, final, ...).
    `wall_s`: when that version existed on the run's clock (published; 0 for the starting weights),
    so accuracy plots against the time it took to get there, not the time the evaluation ran."""

    tag: str
    step: int  # optimizer steps behind the weights
    summary: dict[str, Any]  # accuracy, n, p50, p90, p99, max, mean, p99_over_p50, histogram
    version: int = 0
    wall_s: float = 0.0
    kind = "eval"

    @property
    def accuracy(self) -> float:
        return self.summary["accuracy"]

    def to_json(self) -> dict:
        head = {
            "kind": self.kind,
            "tag": self.tag,
            "step": self.step,
            "version": self.version,
            "wall_s": self.wall_s,
        }
        return {**head, **self.summary}


_EVAL_HEAD = ("kind", "tag", "step", "version", "wall_s")


def on_prompts(summary: dict[str, Any]) -> str:
    """What an accuracy was measured on: 'on 512 prompts', or with several samples a prompt
    (eval.samples) 'on 512 prompts x 4 samples (pass@4 71.2%)'."""
    k = summary.get("samples", 1)
    if k == 1:
        return f"on {summary['n']} prompts"
    return f"on {summary['n']} prompts x {k} samples (pass@{k} {summary['pass_at_k']:.1%})"


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint made after `step` steps: its size on disk and the trainer's time writing it."""

    step: int
    bytes: dict[str, int]  # model (the HF checkpoint), optimizer, total (everything in it)
    seconds: float
    kind = "checkpoint"

    def to_json(self) -> dict:
        return {"kind": self.kind, "step": self.step, "bytes": self.bytes, "seconds": self.seconds}


Metric = StepRecord | EvalRecord | CheckpointRecord


def metric_from_json(d: dict) -> Metric:
    if d.get("kind") == "step":
        return StepRecord(**{k: d[k] for k in StepRecord.__dataclass_fields__ if k in d or k not in OPTIONAL})
    if d.get("kind") == "eval":
        summary = {k: v for k, v in d.items() if k not in _EVAL_HEAD}
        return EvalRecord(d["tag"], d["step"], summary, d.get("version", 0), d.get("wall_s", 0.0))
    if d.get("kind") == "checkpoint":
        return CheckpointRecord(d["step"], d["bytes"], d["seconds"])
    raise ValueError(f"unknown metrics record kind {d.get('kind')!r}")


# -- reading a run directory's files ----------------------------------------------------------


class RecordFormatError(InputError):
    """A line is a JSON object but not a record this tailrace writes: the file comes from another
    tailrace version (or was edited). Damage (a line that is not a JSON object) is skipped instead."""


class DamagedLineWarning(UserWarning):
    """A line that is not a JSON object was skipped; the records after it are read."""


def numbered_lines(path: str | Path) -> Iterator[tuple[int, dict | None]]:
    """(line number, record) for each line of a JSONL file, None for a blank line (where a resume
    quarantined a damaged one) or a damaged line (not a JSON object: warned about, then skipped), so a
    reader keyed by position (journal replay) keeps its positions. A torn last line — a write cut
    short, with no newline — ends the file quietly. A missing file has no lines."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            record = parse_line(raw)
            if not raw.endswith(b"\n") and record is None:
                return
            if record is None and raw.strip():
                warnings.warn(
                    f"{path} line {n} is damaged (not a JSON record); skipped it and read on",
                    DamagedLineWarning,
                    stacklevel=2,
                )
            yield n, record


def parse_line(raw: bytes) -> dict | None:
    """The JSON object a line holds, or None (blank, damaged, or not an object)."""
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        return None
    return d if isinstance(d, dict) else None


def read_lines(path: str | Path) -> Iterator[dict]:
    """The records of a JSONL file, past any damaged line (see `numbered_lines`)."""
    return (d for _, d in numbered_lines(path) if d is not None)


def decode(path: str | Path, n: int, d: dict, from_json: Callable[[dict], Any]) -> Any:
    """`from_json(d)`, a mismatch of shape reported as one line naming the file and line."""
    try:
        return from_json(d)
    except KeyError as e:
        why = f"no field {e.args[0]!r}"
    except (TypeError, ValueError) as e:  # binascii.Error (bad base64) is a ValueError
        why = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
    raise RecordFormatError(
        f"{path} line {n} is not a record this tailrace reads ({why}); the run directory was written by "
        "another tailrace version (or edited): read it with that version, or start a new run"
    )


def _read(path: str | Path, from_json: Callable[[dict], Any]) -> Iterator[Any]:
    return (decode(path, n, d, from_json) for n, d in numbered_lines(path) if d is not None)


def read_journal(path: str | Path) -> Iterator[JournalEntry]:
    return _read(path, journal_from_json)


def read_events(path: str | Path) -> Iterator[Span | Mark]:
    return _read(path, event_from_json)


def read_metrics(path: str | Path) -> Iterator[Metric]:
    return _read(path, metric_from_json)


# -- the one encoder ----------------------------------------------------------------------------

Record = Metric | Span | Mark | JournalEntry


def dumps(record: Record) -> str:
    """One JSON line (without the newline) for any record."""
    return json.dumps(record.to_json(), separators=(",", ":"))


def trained_by_step(
    journal: Iterable[JournalEntry], events: Iterable[Span | Mark]
) -> dict[int, list[tuple[int, int]]]:
    """(prompt length, response length) of each sample a train step took, by step: the `train_issued`
    marks name the groups and, since shaping may train a subset, their sample indices (older runs:
    whole groups); the journal has the lengths of every finished sample."""
    prompt_len: dict[int, int] = {}
    length: dict[tuple[int, int], int] = {}
    for e in journal:
        if isinstance(e, Opened):
            prompt_len[e.group] = len(e.prompt.token_ids)
        elif isinstance(e, Finished):
            length[(e.trajectory.group, e.trajectory.sample_index)] = e.trajectory.length
    indices: dict[int, list[int]] = {}
    for g, i in length:
        indices.setdefault(g, []).append(i)
    out = {}
    for m in events:
        if isinstance(m, Mark) and m.kind == "train_issued":
            picks = m.data.get("samples") or [indices.get(g, []) for g in m.data["groups"]]
            out[m.data["step"]] = [
                (prompt_len.get(g, 0), length[(g, i)])
                for g, idx in zip(m.data["groups"], picks)
                for i in idx
                if (g, i) in length
            ]
    return out


def generated_lengths(journal: Iterable[JournalEntry]) -> list[int]:
    """The response length of every finished sample (trained or not)."""
    return [e.trajectory.length for e in journal if isinstance(e, Finished)]
