"""make_task: spec strings to tasks, and one-line errors for the rest."""

import json
import re

import pytest

from tailrace.tasks.base import TaskError
from tailrace.tasks.registry import make_task


def test_gym_spec_builds_the_named_dataset_with_its_config():
    task = make_task("gym:gcd", {"min_numbers": 3, "max_numbers": 3})
    assert task.name == "gym:gcd"
    q = task.examples("train", 1)[0].question
    assert (
        q.startswith("Find the Greatest Common Divisor") and len(re.findall(r"\d+", q.split(".")[0])) == 3
    ), q


def test_jsonl_spec_builds_a_jsonl_task(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": "#### 2"}) + "\n")
    task = make_task(f"jsonl:{path}", {"question_field": "q", "answer_field": "a", "test_path": str(path)})
    assert task.name == "jsonl:d" and task.examples("test", 1)[0].answer == "2"
    with pytest.raises(TaskError) as e:
        make_task(f"jsonl:{path}", {"question_key": "q"})
    assert str(e.value) == (
        f"jsonl:{path}: unknown task.config key 'question_key'; did you mean question_field? "
        "valid keys: question_field, answer_field, prompt_template, test_mod, test_path"
    )


def test_chainsum_spec_is_the_builtin_task():
    pytest.importorskip("tailrace.tasks.chainsum")
    task = make_task("chainsum")
    assert type(task).__name__ == "ChainSumTask" and task.name == "chainsum"
    short = make_task("chainsum", {"bands": [[1.0, 2, 3]], "max_term": 5})
    for ex in short.examples("train", 50):
        terms = [int(t[1:]) for t in ex.question[2:].split()]
        assert 2 <= len(terms) <= 3 and max(terms) <= 5, ex.question


@pytest.mark.parametrize(
    "config, message",
    [
        ({"bandz": []}, "chainsum: unknown task.config key 'bandz'; did you mean bands? valid keys: bands, "),
        ({"bands": [[0.5, 2, 3]]}, "chainsum: bands=((0.5, 2, 3),): the weights must be >= 0 and sum to 1"),
        ({"bands": [[1.0, 2, 30]]}, "each band is [weight, min terms, max terms] with 1 <= min <= max <= 26"),
        ({"max_term": 0}, "chainsum: max_term=0, test_mod=8: need max_term >= 1"),
        ({"max_term": "9"}, "chainsum: bad task.config {'max_term': '9'}: "),
    ],
)
def test_chainsum_config_errors_are_one_line(config, message):
    with pytest.raises(TaskError) as e:
        make_task("chainsum", config)
    assert message in str(e.value) and "\n" not in str(e.value)


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
    with pytest.raises(TaskError, match="task file not found: /no/such.jsonl"):
        make_task("jsonl:/no/such.jsonl")
