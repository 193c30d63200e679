"""DAPO's soft overlong punishment against values worked out by hand."""

import pytest

from tailrace.tasks.overlong import overlong_penalty


def test_the_penalty_is_zero_before_the_buffer_then_linear_to_the_cap():
    # cap 100, buffer 20: free up to 80 tokens, then 1/20 of the factor a token, -factor at 100
    got = [overlong_penalty(n, cap=100, buffer=20) for n in (0, 79, 80, 81, 90, 99, 100, 130)]
    assert got == pytest.approx([0.0, 0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0])
    assert overlong_penalty(90, cap=100, buffer=20, factor=0.5) == pytest.approx(-0.25)


def test_no_buffer_is_no_penalty():
    assert overlong_penalty(100, cap=100, buffer=0) == 0.0


def test_the_sessions_training_rewards_carry_the_penalty_and_its_evaluation_does_not(tmp_path):
    """cap 40, buffer 10, factor 0.5: a right answer in 6 tokens keeps 1.0, one in 35 tokens 1 - 0.25,
    a wrong one cut at 40 gets -0.5; `correct` and `score` (what evaluation reads) are the task's own."""
    from tailrace.config import load_config
    from tailrace.runtime.session import Session
    from tailrace.types import Finish, GenResult
    from tests.chat_helpers import write_chat_model

    over = ["--rollout.max_new_tokens=40", "--task.overlong_buffer=10", "--task.overlong_penalty=0.5"]
    ses = Session(load_config(None, [f"--model.path={write_chat_model(tmp_path)}", *over]))
    try:
        ex = ses.task.examples("train", 1)[0]
        right = f"A:{ex.answer}"
        texts = [right, "x" * (35 - len(right)) + right, "y" * 38 + "A:"]
        results = []
        for i, text in enumerate(texts):
            ids = tuple(ses.tok.encode(text))
            finish = Finish.LENGTH if len(ids) == 40 else Finish.STOP
            results.append(GenResult(str(i), ids, (0.0,) * len(ids), (0,) * len(ids), finish))
        assert [len(r.token_ids) for r in results] == [len(right), 35, 40]
        prompts = [ses.prompt(ex)] * 3
        trained = ses.train_scores(prompts, results)
        assert [s.reward for s in trained] == pytest.approx([1.0, 0.75, -0.5])
        assert [s.correct for s in trained] == [True, True, False]
        assert [s.reward for s in ses.score(prompts, results)] == [1.0, 1.0, 0.0]
    finally:
        ses.close()
