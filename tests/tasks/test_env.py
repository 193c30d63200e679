"""The environment protocol and its tools: calls answered, failures observed (never raised)."""

from __future__ import annotations

import random
import time

import pytest

from tailrace.tasks.base import Example, TaskError
from tailrace.tasks.chaincalc import ChainCalcTask
from tailrace.tasks.env import Environment, Turn
from tailrace.tasks.registry import make_task, multi_turn
from tailrace.tasks.tools import Calculator, PythonExecutor, ToolError, answer

EX = Example(0, "Q:a7 b3 c9\n", "19")


def test_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    calc = Calculator()
    assert calc.run("10+9") == "19"
    assert calc.run("-(2+3)*4 // 3") == "-7"
    assert calc.run("7/2") == "3.5" and calc.run("6/3") == "2"
    for bad in ("__import__('os')", "x+1", "2**1000", "1/0", "(1,2)", "10+"):
        with pytest.raises(ToolError):
            calc.run(bad)


def test_answer_turns_any_failure_into_an_error_text():
    class Broken:
        name = "broken"

        def run(self, args):
            raise RuntimeError("bug in the tool")

    assert answer(Calculator(), "1/0") == ("error: division by zero", True)
    text, failed = answer(Broken(), "x")
    assert failed and text == "error: RuntimeError: bug in the tool"


def test_step_answers_a_call_and_ends_at_the_response_end():
    env = ChainCalcTask()
    assert env.reset(EX) == EX.question
    assert env.step(EX, "b:[calc:7+3]", 0) == Turn("=10", "calc", False)
    assert env.step(EX, "b:[calc:7+3]=10\nc:[calc:10+9]", 1) == Turn("=19", "calc", False)
    assert env.step(EX, "b:[calc:7+3]=10\nA:10", 1) == Turn(None)  # no call: done, the reward decides
    assert env.reward(EX, "b:[calc:7+3]=10\nc:[calc:10+9]=19\nA:19") == 1.0


def test_a_bad_call_is_observed_and_the_episode_goes_on():
    env = ChainCalcTask()
    t = env.step(EX, "b:[calc:7+]", 0)
    assert t.error and t.observation.startswith("=error: cannot parse")
    t = env.step(EX, "b:[sql:drop table]", 0)
    assert t.error and "unknown tool 'sql'" in t.observation and t.tool is None
    t = env.step(EX, "b:7]", 0)
    assert t.error and "malformed call" in t.observation


def test_max_turns_ends_the_episode_unanswered():
    env = Environment({"calc": Calculator()}, max_turns=3)
    assert env.step(EX, "[calc:1+1]=2[calc:2+2]", 1).observation == "=4"
    assert env.step(EX, "[calc:1+1]=2[calc:2+2]=4[calc:4+4]", 2) == Turn(None)
    with pytest.raises(ValueError, match="max_turns"):
        Environment({}, max_turns=0)


def test_python_executor_runs_in_the_sandbox_and_reports_raise_and_timeout():
    py = PythonExecutor(timeout_s=1.0)
    assert answer(py, "print(6*7)") == ("42", False)
    text, failed = answer(py, "raise ValueError('no')")
    assert failed and text == "error: ValueError: no"
    t0 = time.perf_counter()
    text, failed = answer(py, "while True: pass")
    assert failed and "timeout" in text and time.perf_counter() - t0 < 10
    text, failed = answer(py, "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)")
    assert failed  # no network in the sandbox


def test_registry_builds_it_with_its_knobs_and_refuses_unknown_ones():
    assert multi_turn("chaincalc") and not multi_turn("chainsum")
    task = make_task("chaincalc", {"tools": ["calc", "py"], "max_term": 5}, max_turns=4)
    assert set(task.tools) == {"calc", "py"} and task.max_turns == 4 and task.spec.max_term == 5
    with pytest.raises(TaskError, match="tools"):
        make_task("chaincalc", {"tools": ["shell"]})
    with pytest.raises(TaskError, match="unknown task.config key 'tool'"):
        make_task("chaincalc", {"tool": ["calc"]})


def test_demonstrations_mix_both_ways_and_their_calls_are_answered_as_shown():
    task = ChainCalcTask()
    rng = random.Random(0)
    demos = [task.demonstration(ex, rng) for ex in task.examples("train", 200)]
    tool = [d for d in demos if "[calc:" in d]
    assert 60 < len(tool) < 140
    for d, ex in zip(demos, task.examples("train", 200)):
        assert task.reward(ex, d) == 1.0
    d = tool[0]
    cut = d.index("]") + 1
    assert task.step(Example(0, "", ""), d[:cut], 0).observation == d[cut:].split("\n")[0]


def test_tool_latency_is_added_per_call_and_repeats():
    task = make_task("chaincalc", {"tool_latency_s": 0.02})
    t0 = time.perf_counter()
    waits = []
    for i in range(20):
        s = time.perf_counter()
        assert task.step(EX, f"[calc:{i}+1]", 0).observation == f"={i + 1}"
        waits.append(time.perf_counter() - s)
    assert 0.1 < time.perf_counter() - t0 < 3.0 and max(waits) > 2 * min(waits)  # a spread, not a constant
    with pytest.raises(TaskError, match="tool_latency_s"):
        make_task("chaincalc", {"tool_latency_s": -1})
