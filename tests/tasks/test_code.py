"""CodeTask: completions run against their tests in the sandbox; reward = fraction of asserts passed."""

import json
import os
import socket
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tailrace.tasks.base import Example, TaskError
from tailrace.tasks.code import CodeTask, extract_code
from tailrace.tasks.guard import RewardGuard, Scored
from tailrace.tasks.registry import make_task
from tailrace.tasks.sandbox import SandboxConfig
from tests.tasks.hostile import marked

DATA = Path(__file__).parent / "data" / "code_example.jsonl"
ADD = Example(
    0, "add", "assert add(1, 2) == 3\nassert add(-4, 4) == 0\nassert add(2, 2) == 4\nassert add(0, 5) == 5"
)


def block(code: str) -> str:
    return f"Here it is:\n```python\n{textwrap.dedent(code).strip()}\n```\nDone."


@pytest.fixture(scope="module")
def task():
    return CodeTask(DATA, test_path=DATA, run_timeout_s=0.5, sandbox=SandboxConfig(procs=16, memory_mb=256))


@pytest.fixture(scope="module")
def guard(task):
    with RewardGuard(task, timeout_s=3.0) as g:
        yield g


def test_the_code_is_the_last_python_block():
    assert extract_code("```python\nx = 1\n```\nor better\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("```\nbare = 1\n```") == "bare = 1\n"
    assert extract_code("```python\ncut = 1\n") == "cut = 1\n"  # a generation that ran out of tokens
    assert extract_code("```text\nnot code\n```") == "```text\nnot code\n```"
    assert extract_code("def f(): pass") == "def f(): pass"


def test_the_example_file_loads_and_every_row_has_tests(task):
    assert task.name == "code:code_example" and task.size("test") == 8
    ex = task.examples("test", 1)[0]
    assert ex.question.endswith("in one ```python code block.") and ex.answer.startswith("assert ")


@pytest.mark.parametrize(
    "response, reward",
    [
        (block("def add(a, b):\n    return a + b"), 1.0),
        (block("def add(a, b):\n    return a + b if a else 0"), 0.75),  # add(0, 5) fails
        (block("def add(a, b):\n    return 4"), 0.25),
        (block("def add(a, b) return a + b"), 0.0),  # does not compile
        ("I cannot solve this.", 0.0),
        (block("def add(a, b):\n    return a + b\nraise SystemExit(0)"), 0.0),  # the completion's own exit
        (block("def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    raise SystemExit(1)"), 1.0),
    ],
)
def test_reward_is_the_fraction_of_asserts_that_pass(task, response, reward):
    assert task.reward(ADD, response) == reward  # inline: each run enters a sandbox of its own


def test_a_failing_setup_statement_fails_the_asserts_after_it(task):
    ex = Example(0, "w", "words = word_lengths('a bb')\nassert words['bb'] == 2\nassert len(words) == 2")
    assert task.reward(ex, block("def word_lengths(s):\n    return {w: len(w) for w in s.split()}")) == 1.0
    assert task.reward(ex, block("def word_lengths(s):\n    raise ValueError")) == 0.0


@pytest.mark.parametrize(
    "tests, message",
    [
        (
            "assert f(1) ==",
            r"the tests of train row 0 do not parse \(invalid syntax, line 1\); fix the Python",
        ),
        ("f(1)", r"the tests of train row 0 have no top-level assert; write each test as an assert"),
    ],
)
def test_bad_tests_fail_when_the_task_is_built(tmp_path, tests, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "p", "tests": tests}) + "\n")
    with pytest.raises(TaskError, match=f"^code:bad: {message}"):
        CodeTask(path, test_path=path)


def test_registry_builds_code_tasks():
    task = make_task(f"code:{DATA}", {"test_path": str(DATA)})
    assert isinstance(task, CodeTask) and task.name == "code:code_example"
    task = make_task(f"code:{DATA}", {"test_path": str(DATA), "sandbox": {"cpu_s": 2, "read_paths": ["/x"]}})
    assert task.sandbox == SandboxConfig(cpu_s=2, read_paths=("/x",))
    with pytest.raises(
        TaskError, match=r"^code:\S+ sandbox: unknown task.config key 'cpu'; did you mean cpu_s\?"
    ):
        make_task(f"code:{DATA}", {"sandbox": {"cpu": 2}})
    with pytest.raises(TaskError, match=r"bad task.config sandbox \{'cpu_s': 0\}: sandbox cpu_s=0: must be"):
        make_task(f"code:{DATA}", {"sandbox": {"cpu_s": 0}})
    with pytest.raises(TaskError, match="has no path; write code:<path to .jsonl>"):
        make_task("code:")


# -- through a sandboxed worker, as a run scores -------------------------------------------------
def test_scores_through_the_guard(guard):
    got = guard.score_many(
        [(ADD, block("def add(a, b):\n    return a + b")), (ADD, block("def add(a, b):\n    return 4"))]
    )
    assert got == [Scored(1.0), Scored(0.25)]


def test_an_endless_completion_is_killed(guard):
    got = guard.score(ADD, block("def add(a, b):\n    while True:\n        pass"))
    assert got == Scored(0.0, "raised Contained: timeout after 0.5s")
    assert guard.score(ADD, block("def add(a, b):\n    return a + b")) == Scored(1.0)


def test_a_completion_that_exits_early_scores_nothing(guard):
    got = guard.score(ADD, block("import os\nos._exit(0)"))
    assert got == Scored(0.0, "raised Contained: exited with code 0 without a result")


def test_a_forged_report_out_of_range_is_refused(guard):
    forge = "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'99\\n')\n    except OSError: pass\nos._exit(0)"
    assert guard.score(ADD, block(forge)) == Scored(0.0, "raised Contained: reported 99 passed of 4 tests")


def test_a_completion_that_leaves_processes_is_void_and_they_die(guard):
    comm = "tr-" + uuid.uuid4().hex[:10]
    code = f"""
        import ctypes, os, time
        def add(a, b):
            return a + b
        for _ in range(100):  # a fork bomb, bounded: the process limit stops it at 16
            try:
                if os.fork() == 0:
                    ctypes.CDLL(None).prctl(15, b"{comm}", 0, 0, 0)
                    time.sleep(3600)
            except OSError:
                break
    """
    got = guard.score(ADD, block(code))
    assert got.reward == 0.0 and got.error.startswith("leaked processes")
    deadline = time.monotonic() + 5
    while marked(comm) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marked(comm) == []
    assert guard.score(ADD, block("def add(a, b):\n    return a + b")) == Scored(1.0)


def test_completions_cannot_reach_files_or_network(guard, tmp_path):
    if not {"landlock", "seccomp"} <= set(guard.held.mechanisms):
        pytest.skip(f"needs Landlock and seccomp: {guard.held.notes}")
    secret = tmp_path / "secret.txt"
    secret.write_text("3")
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    steal = f"def add(a, b):\n    return a + b + int(open({str(secret)!r}).read()) - 3"
    phone = f"import socket\ndef add(a, b):\n    socket.create_connection(('127.0.0.1', {port}))\n    return a + b"
    drop = f"def add(a, b):\n    open({str(tmp_path / 'dropped')!r}, 'w').write('x')\n    return a + b"
    hog = "blob = bytearray(1 << 30)\ndef add(a, b):\n    return a + b"
    for code in (steal, phone, drop, hog):
        assert guard.score(ADD, block(code)) == Scored(0.0), code  # each works (1.0) unsandboxed
    assert not (tmp_path / "dropped").exists()
    srv.close()
    assert os.listdir(os.path.join(guard.workdir, "run")) == []  # each run's files are gone
