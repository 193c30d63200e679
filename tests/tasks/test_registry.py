"""make_task: spec strings to tasks, and one-line errors for the rest."""

import json

import pytest

from tailrace.tasks.base import TaskError
from tailrace.tasks.registry import make_task


def test_gym_spec_builds_the_named_dataset_with_kwargs():
    task = make_task("gym:gcd", suffix="")
    assert task.name == "gym:gcd"
    assert task.examples("train", 1)[0].question.startswith("Find the Greatest Common Divisor")


def test_jsonl_spec_builds_a_jsonl_task(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": "#### 2"}) + "\n")
    task = make_task(f"jsonl:{path}", question_field="q", answer_field="a", test_path=path)
    assert task.name == "jsonl:d" and task.examples("test", 1)[0].answer == "2"


def test_chainsum_spec_is_the_builtin_task():
    pytest.importorskip("tailrace.tasks.chainsum")
    task = make_task("chainsum")
    assert type(task).__name__ == "ChainSumTask" and task.name == "chainsum"


@pytest.mark.parametrize("spec", ["chain_sum", "gsm8k.jsonl", "hf:gsm8k", "", "chainsum:x"])
def test_unknown_spec_lists_the_accepted_forms(spec):
    with pytest.raises(TaskError) as e:
        make_task(spec)
    msg = str(e.value)
    assert msg.startswith(f"unknown task spec {spec!r}; use 'chainsum'") and "\n" not in msg
    assert "'gym:<reasoning-gym dataset>'" in msg and "'jsonl:<path to .jsonl>'" in msg


def test_bad_names_inside_a_form_are_one_line():
    with pytest.raises(TaskError, match=r"unknown reasoning-gym dataset 'gcdd'; did you mean gcd"):
        make_task("gym:gcdd")
    with pytest.raises(TaskError, match="has no path"):
        make_task("jsonl:")
    with pytest.raises(TaskError, match="JSONL task file not found: /no/such.jsonl"):
        make_task("jsonl:/no/such.jsonl")
