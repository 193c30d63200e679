"""task.reward: the user's function scores a task's responses in the reward guard's sandboxed worker,
forked or spawned, with the task's questions and answers."""

from pathlib import Path

import pytest

from tailrace.common import ConfigError
from tailrace.tasks.base import TaskError
from tailrace.tasks.guard import RewardGuard
from tailrace.tasks.registry import make_task

ROWS = Path(__file__).resolve().parents[2] / "examples" / "gsm8k_style.jsonl"
REWARD = '''
def exact(question, response, answer):
    """1 for the answer at the end, plus 0.1 for ending with it on a line of its own."""
    text = response.strip()
    score = 1.0 if text.endswith(answer) else 0.0
    return score + (0.1 if text.splitlines()[-1:] == [answer] else 0.0)

def broken(question, response, answer):
    raise ValueError("no " + answer)

def short(question, response, answer):
    return 1.0 if len(response) < 8 else 0.0
'''


@pytest.fixture
def reward_file(tmp_path) -> Path:
    f = tmp_path / "my_reward.py"
    f.write_text(REWARD)
    return f


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_the_users_function_scores_the_tasks_answers_in_the_sandbox(reward_file, start_method):
    task = make_task(f"jsonl:{ROWS}", reward=f"{reward_file}:exact")
    ex = task.examples("train", 1)[0]
    with RewardGuard(task, timeout_s=5.0, start_method=start_method) as g:
        got = g.score_many([(ex, f"so\n{ex.answer}"), (ex, f"it is {ex.answer}!"), (ex, "so 0.5\n")])
    assert [s.reward for s in got] == pytest.approx([1.1, 0.0, 0.0])  # above 1: not clamped to the task's
    assert all(s.error is None for s in got)


def test_a_function_that_raises_scores_zero_with_its_reason(reward_file):
    task = make_task(f"jsonl:{ROWS}", reward=f"{reward_file}:broken")
    ex = task.examples("train", 1)[0]
    with RewardGuard(task, timeout_s=5.0) as g:
        (s,) = g.score_many([(ex, "anything")])
    assert s.reward == 0.0 and s.error == f"raised ValueError: no {ex.answer}"
    assert g.errors["raised ValueError"] == 1


def test_what_cannot_be_loaded_or_used_is_refused_in_one_line(reward_file):
    with pytest.raises(ConfigError, match=r"task.reward=.*my_reward.py:nope: .* has no function 'nope'"):
        make_task(f"jsonl:{ROWS}", reward=f"{reward_file}:nope")
    with pytest.raises(ConfigError, match="task.reward='exact': write it as module:function"):
        make_task(f"jsonl:{ROWS}", reward="exact")
    with pytest.raises(TaskError, match="task.name=chaincalc: a multi-turn task's reward is its own"):
        make_task("chaincalc", reward=f"{reward_file}:exact")


def test_the_example_reward_scores_what_it_says():
    from tailrace.user_code import load_function

    fn = load_function(f"{ROWS.parent / 'rewards.py'}:sum_then_stop", "task.reward")
    q = "Q:a1 b2\n"
    assert fn(q, "a1 b2 = 3\nA:3", "3") == 1.1  # right, and the answer is the last line
    assert fn(q, "A:3\nmore", "3") == 1.0  # right, with more after it
    assert fn(q, "A:4", "3") == 0.1  # wrong, in the format
    assert fn(q, "three", "3") == 0.0


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_several_functions_add_by_their_weights_and_each_is_kept(reward_file, start_method):
    """TRL's reward_funcs and reward_weights; `task` is the task's own reward. A function that raises
    counts 0 with its reason, the others as they are."""
    specs = [f"{reward_file}:exact", "task", f"{reward_file}:short", f"{reward_file}:broken"]
    task = make_task(f"jsonl:{ROWS}", reward=specs, reward_weights=[1.0, 0.5, 0.25, 2.0])
    assert task.part_names == ("exact", "task", "short", "broken")
    ex = task.examples("train", 1)[0]
    right = f"so\n{ex.answer}"
    with RewardGuard(task, timeout_s=5.0, start_method=start_method) as g:
        got = g.score_many([(ex, right), (ex, "so 0.5 and more\n")])
    assert got[0].parts == pytest.approx((1.1, 1.0, float(len(right) < 8), 0.0))
    assert got[0].reward == pytest.approx(1.1 + 0.5 + 0.25 * got[0].parts[2])
    assert got[1].parts == (0.0, 0.0, 0.0, 0.0) and got[1].reward == 0.0
    assert got[0].error == f"raised ValueError: no {ex.answer}" and g.errors["raised ValueError"] == 2


def test_a_list_of_rewards_is_checked_in_one_line(reward_file):
    from tailrace.config import load_config

    with pytest.raises(ConfigError, match=r"task.reward_weights=\[1.0\] has 1 weight for 2 functions"):
        load_config(overrides=[f"--task.reward=[task, {reward_file}:exact]", "--task.reward_weights=[1]"])
    with pytest.raises(ConfigError, match=r"task.reward_weights=\[2.0\] without a list of functions"):
        load_config(overrides=[f"--task.reward={reward_file}:exact", "--task.reward_weights=[2]"])
    with pytest.raises(ConfigError, match=r"task.reward=\[\]: name at least one function"):
        load_config(overrides=["--task.reward=[]"])
    cfg = load_config(overrides=[f"--task.reward=[task, {reward_file}:exact]"])
    assert cfg.task.reward == ["task", f"{reward_file}:exact"] and cfg.task.reward_weights is None
    with pytest.raises(ConfigError, match=r"task.reward=\['task'\]: 'task' alone is the task's own"):
        load_config(overrides=["--task.reward=[task]"])


def test_a_workers_values_of_each_function_are_checked():
    """The sandboxed worker is not trusted: a row's values are finite numbers, one per function (or none:
    a row that failed as a whole)."""
    from tailrace.tasks.guard import _decode

    ok = b'[[0, 1.5, null, [1.0, 0.5]], [1, 0.0, "timeout", []]]'
    assert _decode(ok, 2, 2) == [(0, 1.5, None, (1.0, 0.5)), (1, 0.0, "timeout", ())]
    for bad in (b"[[0, 1.5, null, [1.0]]]", b'[[0, 1.5, null, [1.0, "x"]]]', b"[[0, 1.5, null, [1.0, NaN]]]"):
        with pytest.raises(ValueError, match="malformed"):
            _decode(bad, 2, 2)
