"""--resume on damaged, finished, edited, old, crafted or busy run directories: a correct continuation,
or one line (exit code 2) that names the problem and the fix. Nothing valid is lost either way."""

import json
import os
import pickle
import signal

import pytest

from tailrace.records import Finished, StepRecord, read_journal, read_metrics
from tests.runtime.conftest import (
    TINY_RUN,
    checkpoints,
    copy_run,
    one_line,
    run,
    start_cli,
    unfinish,
    wait_for_steps,
)

pytestmark = pytest.mark.slow


def steps(run_dir):
    return [r.step for r in read_metrics(run_dir / "metrics.jsonl") if isinstance(r, StepRecord)]


def finals(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if getattr(r, "tag", None) == "final"]


def assert_whole(run_dir, n=4, ends=1):
    """Every step once, the final evaluation once (once per end: `ends`), every finished trajectory
    once, the ledger exact."""
    assert steps(run_dir) == list(range(n))
    assert len(finals(run_dir)) == ends
    done = [(e.trajectory.group, e.trajectory.sample_index) for e in read_journal(run_dir / "journal.jsonl")
            if isinstance(e, Finished)]  # fmt: skip
    assert len(done) == len(set(done))
    last = [r for r in read_metrics(run_dir / "metrics.jsonl") if isinstance(r, StepRecord)][-1].ledger
    assert last["produced"] == last["trained"] + last["in_store"] + sum(last["discarded"].values())


class Boom:
    """A pickle that runs a shell command when loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_nothing_read_back_from_a_checkpoint_runs_code(unfinished_run, tmp_path, capsys):
    marker = tmp_path / "pwned"
    crafted = pickle.dumps(Boom(marker))
    newest = checkpoints(unfinished_run)[-1]
    for f in [*newest.rglob("*.pt"), *newest.rglob("*.safetensors")]:
        f.write_bytes(crafted)
    (newest / "trainer.pt").write_bytes(crafted)
    rc, out = run(capsys, "train", f"--resume={unfinished_run}")
    assert not marker.exists(), "a checkpoint file was unpickled"
    assert rc in (0, 2), out


def test_a_torn_journal_line_is_cut_and_the_run_resumes(unfinished_run, capsys):
    journal = unfinished_run / "journal.jsonl"
    done = next(l for l in journal.read_text().splitlines() if '"kind":"done"' in l)
    with open(journal, "a") as f:
        f.write(done[: len(done) // 2])  # killed mid-write
    rc, out = run(capsys, "train", f"--resume={unfinished_run}")
    assert rc == 0, out
    assert "journal.jsonl: cut off a torn last line" in out
    assert all(json.loads(line) for line in journal.read_text().splitlines())  # nothing appended onto it
    assert_whole(unfinished_run)


def test_a_damaged_metrics_line_keeps_every_record_after_it(unfinished_run, capsys):
    metrics = unfinished_run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    first_step = next(i for i, l in enumerate(lines) if '"kind":"step"' in l)
    lines.insert(first_step + 1, '{"kind":"step","step":\x00\n')
    metrics.write_text("".join(lines))
    rc, out = run(capsys, "train", f"--resume={unfinished_run}")
    assert rc == 0, out
    assert "metrics.jsonl.quarantine" in out
    assert_whole(unfinished_run)
    assert json.loads((unfinished_run / "metrics.jsonl.quarantine").read_text())["line"] == first_step + 2


def test_a_lost_journal_entry_after_the_checkpoint_stops_the_replay_there(unfinished_run, capsys):
    journal = unfinished_run / "journal.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    seq = json.loads((checkpoints(unfinished_run)[-1] / "scheduler.json").read_text())["journal_seq"]
    assert len(lines) > seq + 4, "the lost step must have left journal entries after the checkpoint"
    lines[seq + 2] = lines[seq + 2][:40] + "\x00garbled\n"  # the third entry after the checkpoint
    journal.write_text("".join(lines))
    rc, out = run(capsys, "train", f"--resume={unfinished_run}")
    assert rc == 0, out
    assert f"line {seq + 3} after the checkpoint was lost" in out
    quarantined = [
        json.loads(l)["line"] for l in (unfinished_run / "journal.jsonl.quarantine").read_text().splitlines()
    ]
    assert quarantined == list(range(seq + 3, len(lines) + 1))  # the damaged line, then the ones after it
    assert_whole(unfinished_run)


@pytest.mark.parametrize("damage", ["optimizer cut short", "scheduler.json garbled"])
def test_resume_falls_back_to_the_newest_complete_checkpoint(unfinished_run, capsys, damage):
    prev, newest = checkpoints(unfinished_run)[-2:]
    if damage == "optimizer cut short":
        for f in newest.glob("*.safetensors"):
            f.write_bytes(f.read_bytes()[:100])
    else:  # the same size, so only reading it tells
        f = newest / "scheduler.json"
        f.write_text("{" + "x" * (f.stat().st_size - 1))
    leftover = unfinished_run / "checkpoints" / "step_000009.tmp"
    leftover.mkdir()
    (newest / "optimizer.safetensors.tmp").write_bytes(b"half")
    rc, out = run(capsys, "train", f"--resume={unfinished_run}")
    assert rc == 0, out
    assert newest.name in out and prev.name in out
    assert not leftover.exists() and not list(unfinished_run.rglob("*.tmp"))
    assert_whole(unfinished_run)


def test_a_finished_run_refuses_to_resume(finished_run, tmp_path, capsys):
    run_dir = copy_run(finished_run, tmp_path / "run")
    before = (run_dir / "metrics.jsonl").read_bytes()
    rc, out = run(capsys, "train", f"--resume={run_dir}")
    assert rc == 2 and len(out.splitlines()) == 1 and "finished" in out, out
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    # and it says how to train on from there: a new run from the last checkpoint's model
    last = checkpoints(run_dir)[-1] / "model"
    assert f"--model.path={last} starts one from its last weights" in out, out
    # nor does it take other settings: the same way on
    rc, out = run(capsys, "train", f"--resume={run_dir}", "--rollout.temperature=0.5")
    assert (
        rc == 2 and len(out.splitlines()) == 1 and "drop the overrides (--rollout.temperature=0.5)" in out
    ), out
    assert f"--model.path={last} starts one from its last weights" in out, out
    assert (run_dir / "metrics.jsonl").read_bytes() == before


def test_a_finished_run_trains_on_to_more_steps_and_no_fewer(finished_run, tmp_path, capsys):
    """`--resume RUN --flow.steps=N`: from the newest checkpoint, its optimizer and books, on to N steps
    (TRL's and verl's resume with a larger step count); the first end's final evaluation stays."""
    from tailrace.runtime.supervisor import finished

    run_dir = copy_run(finished_run, tmp_path / "run")
    assert finished(run_dir)
    rc, out = run(capsys, "train", f"--resume={run_dir}", "--flow.steps=3")
    assert rc == 2 and len(out.splitlines()) == 1 and "may only grow" in out, out
    rc, out = run(capsys, "train", f"--resume={run_dir}", "--flow.mode=pipe", "--flow.steps=6")
    assert rc == 2 and "drop the overrides" in out and "--flow.steps=N" in out, out
    assert "steps: 4" in (run_dir / "config.yaml").read_text() and finished(run_dir)
    rc, out = run(capsys, "train", f"--resume={run_dir}", "--flow.steps=6")
    assert rc == 0, out
    assert "steps: 6" in (run_dir / "config.yaml").read_text()
    assert_whole(run_dir, n=6, ends=2)
    assert [r.step for r in finals(run_dir)] == [4, 6]
    assert checkpoints(run_dir)[-1].name == "step_000006" and finished(run_dir)
    rc, out = run(capsys, "train", f"--resume={run_dir}")
    assert rc == 2 and "finished" in out and "after step 6" in out, out
    # a supervisor counts a raised run as unfinished until it ends again: it would restart a lost driver
    cfg = run_dir / "config.yaml"
    cfg.write_text(cfg.read_text().replace("steps: 6", "steps: 8"))
    assert not finished(run_dir)


def test_run_dir_at_an_existing_run_is_refused(finished_run, tmp_path, tiny_model, capsys):
    run_dir = copy_run(finished_run, tmp_path / "run")
    before = (run_dir / "metrics.jsonl").read_bytes()
    rc, out = run(capsys, "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN)
    assert rc == 2 and len(out.splitlines()) == 1, out
    assert "--resume" in out and str(run_dir) in out
    assert (run_dir / "metrics.jsonl").read_bytes() == before


def test_an_edited_config_is_refused_unless_the_key_may_change(unfinished_run, capsys):
    cfg = unfinished_run / "config.yaml"
    text = cfg.read_text()
    cfg.write_text(text.replace("mode: sync", "mode: pipe").replace("train_batch: 16", "train_batch: 8"))
    rc, out = run(capsys, "train", f"--resume={unfinished_run}")
    assert rc == 2 and len(out.splitlines()) == 1, out
    assert "flow.mode" in out and "flow.train_batch" in out and "flow.time_limit_s" in out
    cfg.write_text(text.replace("time_limit_s: null", "time_limit_s: 3600.0"))
    rc, out = run(capsys, "train", f"--resume={unfinished_run}")
    assert rc == 0, out
    assert_whole(unfinished_run)


def old_format(run_dir):
    """The journal as tailrace wrote it before packed arrays: a done line holds {"trajectory": {...}}."""
    journal = run_dir / "journal.jsonl"
    out = []
    for line in journal.read_text().splitlines():
        d = json.loads(line)
        if d["kind"] == "done":
            d = {"kind": "done", "trajectory": {k: v for k, v in d.items() if k != "kind"}}
        out.append(json.dumps(d) + "\n")
    journal.write_text("".join(out))


@pytest.mark.parametrize("verb", ["resume", "report", "trace"])
def test_an_old_run_directory_is_one_clear_line(finished_run, tmp_path, capsys, verb):
    run_dir = copy_run(finished_run, tmp_path / "run")
    unfinish(run_dir)
    old_format(run_dir)
    argv = ["train", f"--resume={run_dir}"] if verb == "resume" else [verb, str(run_dir)]
    rc, out = run(capsys, *argv)
    assert rc == 2 and len(out.splitlines()) == 1, out
    assert "journal.jsonl" in out and "version" in out


def test_a_running_run_cannot_be_resumed_alongside(tiny_model, tmp_path, capsys):
    run_dir = tmp_path / "run"
    p = start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.steps=200"
    )
    try:
        wait_for_steps(run_dir, p, 1)
        rc, out = run(capsys, "train", f"--resume={run_dir}")
        assert rc == 2 and len(out.splitlines()) == 1, out
        assert f"pid {p.pid}" in out and "tailrace" in out and "train" in out
        assert p.poll() is None, "the run in progress must go on undisturbed"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    one_line(p.stdout.read())  # no traceback from the refused resume in the run's own output


def test_a_run_ended_by_its_time_limit_checkpoints_its_last_step(capsys, tiny_model, tmp_path):
    """flow.time_limit_s ends the run at a step boundary, and that last step is saved: a 30-minute
    run with hourly checkpoints used to lose everything after its last one."""
    rdir = tmp_path / "run"
    rc, out = run(
        capsys, "train", f"--run-dir={rdir}", f"--model.path={tiny_model}", *TINY_RUN,
        "--flow.steps=50", "--flow.time_limit_s=0.001", "--flow.checkpoint_every=40",
    )  # fmt: skip
    assert rc == 0, out
    steps = [json.loads(x) for x in (rdir / "metrics.jsonl").read_text().splitlines()]
    done = 1 + max(r["step"] for r in steps if r["kind"] == "step")  # step records count from 0
    assert 1 <= done < 50
    assert sorted(p.name for p in (rdir / "checkpoints").glob("step_*")) == [f"step_{done:06d}"]
    # trained on: a limit it has passed is refused, no limit lets it finish its 50 steps
    rc, out = run(capsys, "train", f"--resume={rdir}", "--flow.time_limit_s=0.002")
    assert rc == 2 and "past flow.time_limit_s=0.002; pass a larger --flow.time_limit_s" in out, out
    rc, out = run(capsys, "train", f"--resume={rdir}", "--flow.time_limit_s=null")
    assert rc == 0, out
    assert_whole(rdir, n=50, ends=2)
    rc, out = run(capsys, "train", f"--resume={rdir}", "--flow.time_limit_s=60")
    assert rc == 2 and "trained all its 50 steps; pass a larger --flow.steps" in out, out
