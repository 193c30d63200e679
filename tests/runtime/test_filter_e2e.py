"""`store.filter` on a real run: the user's file-defined keep(prompt, samples) decides which groups train,
refused ones are counted as discarded (reason `filtered`); a filter that breaks mid-run stops it with
one line (exit 2), everything produced kept, and the run resumes once the function is fixed."""

import json

from tailrace.cli import main
from tests.runtime.conftest import TINY_RUN, assert_exact, one_line, run

KEEP_EVEN = """
def keep(prompt, samples):
    assert all(t.prompt_id == prompt.id and t.length > 0 for t in samples)
    return prompt.id % 2 == 0
"""


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def trained_prompts(run_dir):
    opened = {j["group"]: j["prompt"]["id"] for j in lines(run_dir / "journal.jsonl") if j["kind"] == "open"}
    issued = [e for e in lines(run_dir / "events.jsonl") if e.get("kind") == "train_issued"]
    return [opened[g] for e in issued for g in e["groups"]]


def test_a_file_filter_decides_which_groups_train(tiny_model, tmp_path):
    (tmp_path / "filters.py").write_text(KEEP_EVEN)
    run_dir = tmp_path / "run"
    argv = ["train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.steps=3"]
    flags = [
        f"--store.filter={tmp_path / 'filters.py'}:keep",
        "--flow.zero_signal=train",
        "--flow.extra_groups=16",
    ]
    assert main([*argv, *flags]) == 0
    trained = trained_prompts(run_dir)
    assert len(trained) == 3 * 4 and all(p % 2 == 0 for p in trained), trained
    last = lines(run_dir / "metrics.jsonl")
    last = [r for r in last if r["kind"] == "step"][-1]["ledger"]
    assert last["groups"]["dropped"]["filtered"] > 0 and set(last["discarded"]) == {"filtered"}
    assert last["discarded"]["filtered"] == 4 * last["groups"]["dropped"]["filtered"]
    assert_exact(run_dir, steps=3)


def test_a_filter_that_breaks_mid_run_stops_it_in_one_line_and_the_fixed_one_resumes(
    capsys, tiny_model, tmp_path
):
    f = tmp_path / "filters.py"
    run_dir = tmp_path / "run"
    first = run_dir / "checkpoints" / "step_000001"  # broken once there is a checkpoint to resume from
    f.write_text(
        f"from pathlib import Path\ndef keep(prompt, samples):\n    return not Path({str(first)!r}).is_dir() or None\n"
    )
    rc, out = run(capsys, "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN,
                  f"--store.filter={f}:keep", "--flow.zero_signal=train")  # fmt: skip
    line = one_line(out)
    assert rc == 2 and f"store.filter={f}:keep returned None on group" in line and "--resume" in line
    assert (run_dir / "journal.jsonl").stat().st_size > 0  # what was produced is kept
    f.write_text(KEEP_EVEN)
    # a checkpoint of multiversion often holds groups of version 0 with samples to do: the engines keep
    # their own model as version 0 for them (test_resume_versions.py: a resume waited for it forever)
    rc, out = run(capsys, "train", "--resume", str(run_dir))
    assert rc == 0, out[-3000:]
    assert_exact(run_dir, steps=4)
    events = lines(run_dir / "events.jsonl")
    assert not [e for e in events if e.get("kind") == "group_restarted"]


def test_a_filter_that_cannot_be_found_is_one_line_before_anything_starts(capsys, tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    for spec, said in (
        ("nomod_xyz:keep", "cannot import 'nomod_xyz'"),
        ("keep", "write it as module:function"),
    ):
        rc, out = run(
            capsys, "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", f"--store.filter={spec}"
        )
        assert rc == 2 and said in one_line(out) and "store.filter" in one_line(out)
        assert not (run_dir / "journal.jsonl").exists()
