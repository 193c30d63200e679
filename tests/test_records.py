"""Run-directory readers: a torn last line, a damaged line in the middle, a file of another format."""

import json
import warnings

import pytest

from tailrace.records import (
    EvalRecord,
    RecordFormatError,
    dumps,
    read_journal,
    read_metrics,
)


def evals(n):
    return [EvalRecord(f"e{i}", i, {"accuracy": i / 10}) for i in range(n)]


def write(path, lines):
    path.write_text("".join(lines))


def test_a_damaged_middle_line_is_skipped_and_the_records_after_it_are_read(tmp_path):
    f = tmp_path / "metrics.jsonl"
    a, b, c = (dumps(r) + "\n" for r in evals(3))
    write(f, [a, '{"kind": "ev\x00\n', b, c])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(read_metrics(f))
    assert [r.tag for r in got] == ["e0", "e1", "e2"]
    assert (
        len(caught) == 1 and "metrics.jsonl" in str(caught[0].message) and "line 2" in str(caught[0].message)
    )


def test_a_torn_last_line_ends_the_file_quietly(tmp_path):
    f = tmp_path / "metrics.jsonl"
    a, b = (dumps(r) + "\n" for r in evals(2))
    write(f, [a, b[: len(b) // 2]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r.tag for r in read_metrics(f)] == ["e0"]


def test_a_journal_of_an_older_format_is_one_clear_error(tmp_path):
    f = tmp_path / "journal.jsonl"
    old = {"kind": "done", "trajectory": {"group": 0, "index": 1, "tokens": [5, 6]}}
    write(f, [json.dumps(old) + "\n"])
    with pytest.raises(RecordFormatError) as e:
        list(read_journal(f))
    msg = str(e.value)
    assert (
        "\n" not in msg and "journal.jsonl" in msg and "line 1" in msg and "another tailrace version" in msg
    )


def test_trained_by_step_takes_the_samples_a_step_named_or_whole_groups_for_older_runs():
    from tailrace.records import Finished, Mark, Opened, generated_lengths, trained_by_step
    from tailrace.types import Finish, GenResult, Prompt, Trajectory

    def done(g, i, n):
        r = GenResult(f"{g}.{i}", (7,) * n, (0.0,) * n, (0,) * n, Finish.STOP)
        return Finished(Trajectory(g, i, g, (1, 2), r, reward=0.0, correct=False))

    journal = [Opened(0, 0, 1, False, Prompt(0, (1, 2, 3), "")), done(0, 0, 5), done(0, 1, 9), done(0, 2, 4)]
    shaped = [Mark(1.0, "train_issued", {"step": 0, "groups": [0], "samples": [[0, 2]]})]
    assert trained_by_step(journal, shaped) == {0: [(3, 5), (3, 4)]}
    older = [Mark(1.0, "train_issued", {"step": 0, "groups": [0]})]
    assert trained_by_step(journal, older) == {0: [(3, 5), (3, 9), (3, 4)]}
    assert generated_lengths(journal) == [5, 9, 4]
