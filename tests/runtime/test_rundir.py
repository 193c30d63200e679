"""The run directory's JSONL files before a resume appends to them: a torn last line is cut off, a
damaged line is quarantined (its position kept), and every valid record stays."""

import json
import warnings

from tailrace.records import EvalRecord, dumps, numbered_lines, read_metrics
from tailrace.runtime.rundir import RecordFile, repair


def lines(n):
    return [dumps(EvalRecord(f"e{i}", i, {"accuracy": 0.5})) + "\n" for i in range(n)]


def test_a_torn_last_line_is_cut_before_appending(tmp_path):
    f = tmp_path / "journal.jsonl"
    a, b = lines(2)
    f.write_text(a + b[:20])
    note = repair(f)
    assert note.torn and "journal.jsonl" in note.message() and "\n" not in note.message()
    out = RecordFile(f)
    out.write(EvalRecord("new", 9, {"accuracy": 1.0}))
    out.close()
    assert [r.tag for r in read_metrics(f)] == ["e0", "new"]


def test_a_whole_last_record_missing_its_newline_is_kept(tmp_path):
    f = tmp_path / "metrics.jsonl"
    a, b = lines(2)
    f.write_text(a + b.rstrip("\n"))
    assert not repair(f).torn
    assert f.read_text() == a + b


def test_a_damaged_line_is_quarantined_in_place_and_the_rest_kept(tmp_path):
    f = tmp_path / "journal.jsonl"
    a, b, c = lines(3)
    f.write_text(a + "{garbage\n" + b + "[1, 2]\n" + c)
    note = repair(f)
    assert note.quarantined == (2, 4)
    assert "lines 2, 4 to" in note.message() and "journal.jsonl.quarantine" in note.message()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing damaged is left to warn about
        slots = list(numbered_lines(f))
    assert [n for n, d in slots] == [1, 2, 3, 4, 5]  # positions kept: blank lines where damage was
    assert [d["tag"] if d else None for _, d in slots] == ["e0", None, "e1", None, "e2"]
    moved = [json.loads(x) for x in (tmp_path / "journal.jsonl.quarantine").read_text().splitlines()]
    assert moved == [{"line": 2, "text": "{garbage"}, {"line": 4, "text": "[1, 2]"}]
    assert repair(f).message() == ""  # nothing left to do


def test_a_missing_or_sound_file_is_left_alone(tmp_path):
    f = tmp_path / "events.jsonl"
    assert repair(f).message() == "" and not f.exists()
    f.write_text("".join(lines(2)))
    before = f.stat().st_mtime_ns
    assert repair(f).message() == "" and f.stat().st_mtime_ns == before
