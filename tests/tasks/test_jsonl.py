"""JsonlTask: reading and checking files, deterministic disjoint splits, math-verify rewards."""

import json

import pytest

from tailrace.tasks.base import TaskError
from tailrace.tasks.jsonl import JsonlTask, gold_text


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def gsm(tmp_path):
    rows = [
        {
            "question": f"Tom has {i} apples and buys 3. How many?",
            "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}",
        }
        for i in range(200)
    ]
    return write(tmp_path / "gsm.jsonl", rows)


def test_gsm8k_answers_are_normalized(gsm):
    task = JsonlTask(gsm)
    assert task.name == "jsonl:gsm"
    ex = task.examples("train", 1)[0]
    n = int(ex.question.split()[2])
    assert ex.answer == str(n + 3)
    assert gold_text("She pays 2*36=72\n#### 72 ") == "72"
    assert gold_text(1000) == "1000"


def test_reward_uses_math_verify(gsm):
    task = JsonlTask(gsm)
    ex = task.examples("test", 1)[0]
    right = int(ex.answer)
    assert task.reward(ex, f"3 more apples, so the answer is {right}.") == 1.0
    assert task.reward(ex, f"Working: 1+2=3.\n#### {right}") == 1.0
    assert task.reward(ex, f"\\boxed{{{right}.0}}") == 1.0
    assert task.reward(ex, f"The answer is {right + 1}.") == 0.0
    assert task.reward(ex, "no idea") == 0.0


def test_restating_the_question_is_not_an_answer(tmp_path):
    """SmolLM2-135M answered "What is 51 + 86 + 38?" with "To add 51 + 86 + 38, we need to combine the
    numbers ..." and math-verify scored it 1: it evaluated the restated sum. A sum of literals is
    never a final answer; the computed value, anywhere math-verify finds it last, still is."""
    rows = [{"question": "What is 51 + 86 + 38?", "answer": "175"}, {"question": "half?", "answer": "1/2"}]
    task = JsonlTask(write(tmp_path / "a.jsonl", rows), test_path=write(tmp_path / "t.jsonl", rows))
    add, half = task.rows["test"]
    assert task.reward(add, "To add 51 + 86 + 38, we need to combine the numbers in a way") == 0.0
    assert task.reward(add, "51 + 86 + 38") == 0.0
    assert task.reward(add, "(51 + 86) + 38") == 0.0
    assert task.reward(add, "51 + 86 + 38 = 175") == 1.0
    assert task.reward(add, "The answer is 175.") == 1.0
    assert task.reward(half, "It is 1/2") == 1.0
    assert task.reward(half, "It is 2/4") == 1.0


def test_a_held_out_set_smaller_than_eval_n_is_evaluated_once_each(tmp_path):
    rows = [{"question": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(10)]
    task = JsonlTask(write(tmp_path / "a.jsonl", rows), test_path=write(tmp_path / "t.jsonl", rows))
    with pytest.warns(UserWarning, match="eval.n=128 but the test split has 10 questions"):
        held = task.examples("test", 128)
    assert sorted(e.question for e in held) == sorted(r["question"] for r in rows)
    assert len(task.examples("train", 25)) == 25  # training cycles in epochs as before


def test_equivalent_latex_forms_are_accepted(tmp_path):
    rows = [
        {"problem": "half?", "solution": "\\frac{1}{2}"},
        {"problem": "root?", "solution": "\\frac{\\sqrt{2}}{2}"},
        {"problem": "square?", "solution": "x^2+2x+1"},
    ]
    task = JsonlTask(
        write(tmp_path / "math.jsonl", rows),
        question_field="problem",
        answer_field="solution",
        test_path=write(tmp_path / "t.jsonl", rows),
    )
    half, root, square = task.rows["test"]  # file order
    assert task.reward(half, "So it is \\boxed{0.5}") == 1.0
    assert task.reward(half, "$\\frac{2}{4}$") == 1.0
    assert task.reward(half, "\\boxed{\\frac{1}{3}}") == 0.0
    assert task.reward(root, "\\boxed{\\sqrt{2}/2}") == 1.0
    assert task.reward(square, "\\boxed{(x+1)^2}") == 1.0
    assert task.reward(square, "\\boxed{(x+2)^2}") == 0.0


def test_split_is_deterministic_disjoint_and_hash_based(gsm):
    task = JsonlTask(gsm, test_mod=4)
    assert 25 <= task.size("test") <= 75 and task.size("train") + task.size("test") == 200
    train = {e.question for e in task.rows["train"]}
    test = {e.question for e in task.rows["test"]}
    assert not train & test
    lines = gsm.read_text().splitlines()
    reordered = write(gsm.parent / "rev.jsonl", reversed(lines))
    assert {e.question for e in JsonlTask(reordered, test_mod=4).rows["test"]} == test


def test_examples_are_reproducible_and_cycle_in_epochs(gsm):
    task = JsonlTask(gsm)
    a = task.examples("train", 50, seed=3)
    assert a == task.examples("train", 50, seed=3) and a != task.examples("train", 50, seed=4)
    m = task.size("train")
    many = task.examples("train", 2 * m)
    assert [e.id for e in many] == list(range(2 * m))
    assert {e.question for e in many[:m]} == {e.question for e in task.rows["train"]}  # one epoch
    assert len({e.question for e in many}) == m


def test_prompt_template_fills_fields_and_leaves_latex_braces(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"q": "2+2?", "a": "4", "level": 3}])
    task = JsonlTask(
        path,
        question_field="q",
        answer_field="a",
        test_path=path,
        prompt_template="[L{level}] {question}\nPut it in \\boxed{}.",
    )
    assert task.rows["test"][0].question == "[L3] 2+2?\nPut it in \\boxed{}."
    with pytest.raises(TaskError, match=r"no \{question\} placeholder"):
        JsonlTask(path, question_field="q", answer_field="a", prompt_template="Solve it")


@pytest.mark.parametrize(
    "line, what",
    [
        ('{"question": "a", "answer": ', "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"question": "a"}', "missing field 'answer' (has question); add it, or pass answer_field="),
    ],
)
def test_malformed_line_names_file_line_and_fix(tmp_path, line, what):
    path = write(tmp_path / "bad.jsonl", [{"question": "q1", "answer": "1"}, "", line])
    with pytest.raises(TaskError) as e:
        JsonlTask(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: {what}") and "\n" not in msg


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TaskError, match=r"^task file not found: .*nope\.jsonl; pass the path"):
        JsonlTask(tmp_path / "nope.jsonl")
    with pytest.raises(TaskError, match="no rows"):
        JsonlTask(write(tmp_path / "empty.jsonl", ["", "  "]))


def test_empty_split_is_reported(tmp_path):
    path = write(tmp_path / "one.jsonl", [{"question": "only", "answer": "1"}])
    task = JsonlTask(path, test_mod=100)
    empty = "test" if task.size("train") else "train"
    with pytest.raises(TaskError, match=f"the {empty} split is empty"):
        task.examples(empty, 1)


def test_scores_the_same_through_a_reward_guard_worker(gsm):
    from tailrace.tasks.guard import RewardGuard

    task = JsonlTask(gsm)
    ex = task.examples("train", 1)[0]
    pairs = [(ex, f"so the answer is {ex.answer}"), (ex, "so the answer is -1")]
    with RewardGuard(task) as guard:
        assert [s.reward for s in guard.score_many(pairs)] == [1.0, 0.0]
    assert guard.errors == {}


CHAT_ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"},
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6 x 7?"}],
        "answer": "42",
    },
    {
        "prompt": [
            {"role": "user", "content": "Add 1 and 1."},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "Now double it."},
        ],
        "answer": "4",
    },
]


def _chat_file(tmp_path, rows=CHAT_ROWS):
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_a_row_of_chat_messages_keeps_them_and_its_last_users_turn_is_the_question(tmp_path):
    """TRL's conversational format: the prompt field a list of {role, content}; the messages go through
    the chat template as they are, the question (what a reward reads) is the last user turn."""
    t = JsonlTask(_chat_file(tmp_path), question_field="prompt", test_path=_chat_file(tmp_path))
    exs = t.examples("train", 6, seed=1)
    by_answer = {e.answer: e for e in exs}
    assert by_answer["42"].messages == (("system", "Be brief."), ("user", "6 x 7?"))
    assert by_answer["42"].question == "6 x 7?"
    assert by_answer["4"].messages[-1] == ("user", "Now double it.") and len(by_answer["4"].messages) == 3
    assert [e.id for e in exs] == list(range(6))  # ids renumbered as any task's, messages kept
    assert all(e.messages for e in exs)


@pytest.mark.parametrize(
    "prompt, said",
    [
        ([{"role": "bot", "content": "hi"}], "message 0 is .*each must be"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "the messages must end with the user's",
        ),
        ([], "the messages must end with the user's"),
    ],
)
def test_bad_chat_messages_are_refused_naming_the_line(tmp_path, prompt, said):
    with pytest.raises(TaskError, match=r"chat.jsonl:2: 'prompt': " + said):
        JsonlTask(
            _chat_file(tmp_path, [CHAT_ROWS[0], {"prompt": prompt, "answer": "1"}]), question_field="prompt"
        )


def test_a_template_cannot_wrap_chat_messages(tmp_path):
    with pytest.raises(TaskError, match="holds chat messages, which prompt_template="):
        JsonlTask(_chat_file(tmp_path), question_field="prompt", prompt_template="Solve: {question}")


def test_a_verl_parquet_file_reads_as_its_jsonl_rows(tmp_path):
    """verl's RL data: parquet rows with the prompt as chat messages and the answer nested under
    reward_model.ground_truth (a dotted answer_field), through the same task as a JSONL file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tailrace.tasks.registry import make_task

    rows = [
        {
            "data_source": "sums",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        }
        for i in range(40)
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    task = make_task(
        f"parquet:{path}", {"question_field": "prompt", "answer_field": "reward_model.ground_truth"}
    )
    assert task.name == "parquet:train"
    exs = task.examples("train", task.size("train"))
    assert {e.answer for e in exs} <= {str(2 * i) for i in range(40)} and len(exs) == task.size("train")
    e = exs[0]
    assert (
        e.messages == (("user", e.question),)
        and e.question == f"What is {int(e.answer) // 2} + {int(e.answer) // 2}?"
    )
    assert task.size("train") + task.size("test") == 40
    assert task.reward(e, f"so \\boxed{{{e.answer}}}") == 1.0
    with pytest.raises(TaskError, match=r"train.parquet row 0: missing field 'reward_model.answer'"):
        make_task(f"parquet:{path}", {"question_field": "prompt", "answer_field": "reward_model.answer"})
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(TaskError, match="bad.parquet: not a parquet file pyarrow reads"):
        make_task(f"parquet:{bad}")
