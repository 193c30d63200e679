"""`tailrace train --resume RUN_DIR`: everything a resume reads is checked before anything changes.

    plan_resume(run)   read only: refuses a finished run, a config edited in a key that may not change,
                       an older format; picks the newest whole checkpoint (newer damaged ones are
                       skipped) and reads the journal written after it
    Resume.commit()    then changes the run directory: removes what interrupted writes left, moves
                       damaged checkpoints aside, repairs the JSONL files (a torn last line cut off,
                       damaged lines quarantined), drops the metrics of steps the checkpoint lacks;
                       one line per change, for the user
    Resume.restore(s)  the checkpoint's scheduler state into a fresh scheduler, then the journal

The journal is positional (a checkpoint holds the number of entries it counts), so a damaged journal
line keeps its place as a blank line. A lost entry after the checkpoint cannot be replayed around (a
lost `Opened` would orphan its group): the replay stops there and the lines from it on are
quarantined, as if the run had been killed at that point; their samples are generated again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailrace.common import ConfigError, InputError, one_line
from tailrace.config import RunConfig, load_config
from tailrace.records import (
    EvalRecord,
    JournalEntry,
    StepRecord,
    decode,
    journal_from_json,
    numbered_lines,
    read_metrics,
)
from tailrace.runtime import checkpoint
from tailrace.runtime.rundir import RunDir, cut_from, extended, repair, truncate_metrics

# Keys a resume may see changed: none of them alters what the run computes. Every other key (model,
# task, batch shape, mode, optimizer, sampling, evaluation — the final evaluation must compare with
# the base one already recorded) must stay as the checkpoint was made.
MAY_CHANGE = (
    "flow.time_limit_s", "flow.checkpoint_every", "flow.checkpoint_minutes", "flow.keep_checkpoints",
    "rollout.threads", "task.reward_timeout_s", "eval.batch", "tensorboard", "worker_timeout_s", "max_restarts",
    "out", "rollout.spec.drafter", "rollout.spec.toggle", "rollout.spec.min_speedup", "rollout.spec.gamma_min",
    "rollout.spec.gamma_max",  # speculation is exact: it changes the time, never a token
    "task.tool_threads",  # a multi-turn run's tool pool: when tools answer, not what
)  # fmt: skip


@dataclass
class Resume:
    run: RunDir
    cfg: RunConfig
    checkpoint: Path
    state: dict[str, Any]  # its scheduler.json
    tail: list[JournalEntry]  # journal entries after the checkpoint, up to the first lost one
    cut: int | None  # journal line (1-based) from which the rest is quarantined; None: none lost
    damaged: list[tuple[Path, str]] = field(default_factory=list)  # newer checkpoints, and why
    changed: list[str] = field(default_factory=list)  # keys of MAY_CHANGE that changed
    finished: bool = False  # a policy of several that finished (its final evaluation recorded)

    @property
    def version(self) -> int:
        return self.state["version"]

    def commit(self) -> list[str]:
        notes = []
        for p in checkpoint.leftovers(self.run.path):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            notes.append(f"removed {p}, left by an interrupted write")
        for p, why in self.damaged:
            aside = next(a for i in range(1, 1000) if not (a := p.with_name(f"{p.name}.damaged{i}")).exists())
            os.replace(p, aside)
            notes.append(f"checkpoint {p.name} is damaged ({why}): moved it to {aside.name}")
        for name in ("journal.jsonl", "metrics.jsonl", "events.jsonl"):
            notes.append(repair(self.run.file(name)).message())
        if self.cut is not None:
            notes.append(_cut(self.run.file("journal.jsonl"), self.cut))
        done = self.state["steps_done"]
        truncate_metrics(
            self.run.file("metrics.jsonl"),
            lambda r: r.step < done if isinstance(r, StepRecord) else r.step <= done,
        )
        if self.finished:
            notes.append(f"finished at step {done}: it waits for the others")
        else:
            notes.append(f"resuming from checkpoint {self.checkpoint.name} (step {done})")
        if self.changed:
            notes.append(f"with config.yaml changed in {', '.join(self.changed)}")
        return [n for n in notes if n]

    def restore(self, sched) -> None:
        """Load the checkpoint's scheduler state into a fresh scheduler and replay the journal tail."""
        f = self.checkpoint / checkpoint.SCHEDULER
        try:
            sched.load_state_dict(self.state)
        except (KeyError, TypeError, ValueError, AttributeError, StopIteration) as e:
            raise InputError(f"{f} does not load ({one_line(e)}); move {self.checkpoint} away to resume "
                             "from the checkpoint before it") from None  # fmt: skip
        try:
            sched.replay(self.tail)
        except Exception as e:  # noqa: BLE001 — a journal edited or damaged into nonsense
            raise InputError(
                f"{self.run.file('journal.jsonl')} does not replay onto {f} ({type(e).__name__}: {one_line(e)}); "
                "the run directory is damaged: start a new run"
            ) from None


def plan_resume(run: RunDir, finished_ok: bool = False) -> Resume:
    """Check everything a resume of `run` reads; raise `InputError` (one line) where it cannot go on.
    `finished_ok`: a finished run is planned too (`Resume.finished`), from its last checkpoint (a policy
    of several that finished before the others)."""
    try:
        cfg = load_config(run.file("config.yaml"))
    except ConfigError as e:
        raise ConfigError(f"{run.file('config.yaml')}: {e}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # damaged lines: commit() quarantines them and says so
        final = [
            r
            for r in read_metrics(run.file("metrics.jsonl"))
            if isinstance(r, EvalRecord) and r.tag == "final"
        ]
        if extended(run.path):  # --flow.steps raised: the final evaluation recorded was not the end
            final = []
        if final and not finished_ok:
            raise InputError(
                f"--resume {run.path}: the run finished (held-out accuracy {final[-1].accuracy:.1%} after "
                f"step {final[-1].step}); start a new run (tailrace report {run.path} reports this one)"
                + train_on(run)
            )
        chosen, damaged = _newest_whole(run)
        changed = _changed(run, chosen, cfg)
        state = json.loads((chosen / checkpoint.SCHEDULER).read_text())
        tail, cut = _journal_after(run.file("journal.jsonl"), state["journal_seq"])
    return Resume(run, cfg, chosen, state, tail, cut, damaged, changed, finished=bool(final))


def train_on(run: RunDir, whose: str = "its") -> str:
    """How a new run starts from `run`'s last weights (its newest whole checkpoint's HF model; a LoRA
    run's is merged there at its end), for a message that refuses to extend `run`; "" if it has none."""
    for ckpt in checkpoint.step_dirs(run.ckpt):
        if checkpoint.verify(ckpt) is None and (ckpt / "model").is_dir():
            return (
                f"; --model.path={ckpt / 'model'} starts one from {whose} last weights (the optimizer afresh)"
            )
    return ""


def _newest_whole(run: RunDir) -> tuple[Path, list[tuple[Path, str]]]:
    damaged = []
    for ckpt in checkpoint.step_dirs(run.ckpt):
        why = checkpoint.verify(ckpt)
        if why is None:
            return ckpt, damaged
        damaged.append((ckpt, why))
    if damaged and all("older tailrace" in why for _, why in damaged):
        raise InputError(
            f"--resume {run.path}: its checkpoints were {damaged[0][1]}; finish it with that version, "
            "or start a new run"
        )
    raise InputError(
        f"--resume {run.path}: no complete checkpoint yet, so nothing to continue; start the run again "
        f"(remove {run.path} or pass another --run-dir)"
    )


def _changed(run: RunDir, ckpt: Path, cfg: RunConfig) -> list[str]:
    try:
        then = _flat(dataclasses.asdict(load_config(ckpt / checkpoint.CONFIG)))
    except ConfigError as e:
        raise ConfigError(f"{ckpt / checkpoint.CONFIG}: {e}") from None
    now = _flat(dataclasses.asdict(cfg))
    changed = _differ(then, now)
    if "flow.steps" in changed and now["flow.steps"] < then["flow.steps"]:
        raise ConfigError(
            f"--resume {run.path}: config.yaml lowered flow.steps ({then['flow.steps']} -> {now['flow.steps']}) "
            f"since checkpoint {ckpt.name}; a run's steps may only grow: restore it, or start a new run"
        )
    refused = [k for k in changed if k not in (*MAY_CHANGE, "flow.steps")]
    if refused:
        diffs = ", ".join(f"{k} ({then.get(k)} -> {now[k]})" for k in refused)
        raise ConfigError(
            f"--resume {run.path}: config.yaml changed {diffs} since checkpoint {ckpt.name}; a resume "
            f"continues the run as it was: restore them, or start a new run (only {', '.join(MAY_CHANGE)} "
            "may change, and flow.steps grow)"
        )
    return changed


def changed_keys(then: RunConfig, now: RunConfig) -> list[str]:
    """The keys whose values differ between two configs, but those a resume may see changed."""
    differ = _differ(_flat(dataclasses.asdict(then)), _flat(dataclasses.asdict(now)))
    return [k for k in differ if k not in MAY_CHANGE]


def _differ(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys of flat config `now` whose values `then` does not have."""
    return [k for k in now if now[k] != then.get(k)]


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _journal_after(path: Path, seq: int) -> tuple[list[JournalEntry], int | None]:
    """The entries after the first `seq` lines, up to the first lost one; every line is decoded (an
    older format anywhere is refused now, not after the run has gone on)."""
    tail: list[JournalEntry] = []
    cut = None
    for n, d in numbered_lines(path):
        entry = decode(path, n, d, journal_from_json) if d is not None else None
        if n > seq and cut is None:
            if entry is None:
                cut = n
            else:
                tail.append(entry)
    return tail, cut


def _cut(journal: Path, line: int) -> str:
    n = cut_from(journal, line)
    return (
        f"{journal}: line {line} after the checkpoint was lost, so the replay stops there; lines {line}-{n} "
        f"moved to {journal.name}.quarantine (their samples are generated again)"
    )
