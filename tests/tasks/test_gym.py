"""ReasoningGymTask: deterministic disjoint splits, the dataset's own scoring, one-line errors."""

import pickle
import re

import pytest

from tailrace.tasks.base import TaskError, in_test_split
from tailrace.tasks.gym import ReasoningGymTask, extract_answer

# countdown scores with the entry's metadata (the numbers given), so it checks the handle round trip
DATASETS = ["basic_arithmetic", "gcd", "countdown"]


@pytest.fixture(scope="module", params=DATASETS)
def task(request):
    return ReasoningGymTask(request.param)


def test_splits_are_deterministic_and_disjoint(task):
    n = 4 if task.dataset == "countdown" else 48  # countdown generates ~15 ms per item
    train, test = task.examples("train", n), task.examples("test", n)
    assert [e.id for e in train] == list(range(n))
    assert train == task.examples("train", n) and test == task.examples("test", n)
    assert not {e.question for e in train} & {e.question for e in test}
    assert task.examples("train", n, seed=1) != train
    assert task.examples("train", n // 2) == train[: n // 2]  # a longer request extends a shorter


def test_reward_accepts_the_gold_answer_and_rejects_a_wrong_one(task):
    ex = task.examples("test", 2)[1]
    gold = ReasoningGymTask.gold(ex)
    assert ex.question.endswith("'Answer: <answer>'.")
    assert task.reward(ex, f"Let me think.\nAnswer: {gold}") == 1.0
    assert task.reward(ex, f"<answer>{gold}</answer>") == 1.0
    assert task.reward(ex, "Answer: 999999999") < 1.0
    assert task.reward(ex, "no idea") < 1.0


@pytest.mark.parametrize("renew", ["new", "pickled"])
def test_reward_is_the_same_in_a_fresh_task_object(task, renew):
    """The handle alone locates the entry: a new task (as in a spawned worker) scores the same."""
    ex = task.examples("train", 1)[0]
    gold = ReasoningGymTask.gold(ex)
    fresh = ReasoningGymTask(task.dataset) if renew == "new" else pickle.loads(pickle.dumps(task))
    assert not fresh._entries
    assert fresh.reward(ex, f"Answer: {gold}") == 1.0
    assert fresh.reward(ex, "Answer: 999999999") == task.reward(ex, "Answer: 999999999")


def test_extract_answer_forms():
    assert extract_answer("x <answer> 7 </answer> y Answer: 8") == "7"
    assert extract_answer("Answer: 3\nthen Answer: 4 ") == "4"
    assert extract_answer("  42 \n") == "42"
    assert extract_answer("<answer>7</answer>", tag=None, marker=None) == "<answer>7</answer>"
    assert extract_answer("Result= 5", tag=None, marker="Result=") == "5"


def test_suffix_and_markers_are_configurable():
    t = ReasoningGymTask("basic_arithmetic", suffix="", answer_tag=None, answer_marker="=>")
    ex = t.examples("train", 1)[0]
    gold = ReasoningGymTask.gold(ex)
    assert not ex.question.endswith("'.") and ex.question.startswith("Calculate")
    assert t.reward(ex, f"work => {gold}") == 1.0
    assert t.reward(ex, f"<answer>{gold}</answer>") < 1.0  # tags are not read when disabled


def test_unknown_dataset_is_one_line_with_close_matches():
    with pytest.raises(TaskError) as e:
        ReasoningGymTask("basic_arithmetc")
    msg = str(e.value)
    assert "\n" not in msg and "'basic_arithmetc'" in msg
    assert "did you mean basic_arithmetic" in msg and "gym_names()" in msg


def test_bad_config_is_one_line():
    with pytest.raises(TaskError) as e:
        ReasoningGymTask("gcd", config={"max_number": 1})
    assert str(e.value) == (
        "gym:gcd: unknown task.config key 'max_number'; did you mean max_numbers? "
        "valid keys: min_numbers, max_numbers, min_value, max_value, size"
    )
    with pytest.raises(
        TaskError, match=r"^gym:gcd: bad config \{'min_numbers': 0\}: .*; fix the config values$"
    ):
        ReasoningGymTask("gcd", config={"min_numbers": 0})
    with pytest.raises(
        TaskError, match="task.config seed is derived per block from task.seed; set task.seed"
    ):
        ReasoningGymTask("gcd", config={"seed": 3})


def test_config_reaches_the_dataset():
    t = ReasoningGymTask(
        "basic_arithmetic", config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    )
    for ex in t.examples("train", 20):
        numbers = re.findall(r"\d+", ex.question.split("\n")[0])
        assert len(numbers) == 2 and all(len(x) == 1 for x in numbers), ex.question


def test_task_config_from_the_command_line_reaches_the_dataset():
    """--task.config as a YAML mapping, through the run config and make_task, as a run builds it;
    its `size` is the generated block size."""
    from tailrace.config import load_config
    from tailrace.tasks.registry import make_task

    flags = ["--task.name=gym:basic_arithmetic", "--task.config={min_terms: 3, max_terms: 3, size: 64}"]
    cfg = load_config(None, [*flags, "--task.config.max_digits=1", "--task.config.min_digits=1"])
    t = make_task(cfg.task.name, cfg.task.config)
    assert t.block == 64 and t.config == {"min_terms": 3, "max_terms": 3, "max_digits": 1, "min_digits": 1}
    for ex in t.examples("test", 10):
        numbers = re.findall(r"\d+", ex.question.split("\n")[0])
        assert len(numbers) == 3 and all(len(x) == 1 for x in numbers), ex.question
    default = make_task("gym:basic_arithmetic")
    assert default.examples("test", 10) != t.examples("test", 10)


def test_unknown_split():
    with pytest.raises(TaskError, match="unknown split 'dev'"):
        ReasoningGymTask("gcd").examples("dev", 1)


def test_too_small_question_space_fails_instead_of_looping(monkeypatch):
    one = {"question": "Q", "answer": "1", "metadata": {}}  # a dataset with a single question
    t = ReasoningGymTask("gcd")
    monkeypatch.setattr(t, "_entry", lambda seed, index: one)
    empty = "train" if in_test_split("Q", t.test_mod) else "test"
    with pytest.raises(TaskError, match=f"found only 0 of 1 {empty} examples in 4096 generated"):
        t.examples(empty, 1)


def test_scores_the_same_through_a_reward_guard_worker():
    from tailrace.tasks.guard import RewardGuard

    task = ReasoningGymTask("countdown")
    ex = task.examples("train", 1)[0]
    pairs = [(ex, f"Answer: {ReasoningGymTask.gold(ex)}"), (ex, "Answer: 1+1")]
    with RewardGuard(task, timeout_s=5.0) as guard:
        assert [s.reward for s in guard.score_many(pairs)] == [task.reward(*p) for p in pairs]
    assert task.reward(*pairs[0]) == 1.0 and task.reward(*pairs[1]) < 1.0
