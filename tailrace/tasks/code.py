"""code:<path> — programming problems from JSONL, scored by running the completion against tests.

Each row has a problem statement and its tests, MBPP/HumanEval-like:

    {"prompt": "Write a function add(a, b) that returns a + b.", "tests": "assert add(1, 2) == 3\n..."}

The reward is the fraction of the tests' top-level `assert` statements that pass (1.0: all pass;
partial credit gives the policy a gradient before it solves a problem). The code is the last
```python fenced block of the response (or the whole response without one). It runs in a fresh child
process inside the reward sandbox (tasks/sandbox/isolated.py), as module `solution` (so its
`if __name__ == "__main__":` demo does not run), followed by the tests' statements in order in the
same namespace; a statement other than an assert that fails ends the run, and its asserts count as
failed. A run that times out, is killed by a limit or exits before reporting raises `Contained`,
which the guard counts and scores 0. The run shares its process with the tests: the sandbox protects
the machine from the completion, not the tests from a completion written to game them (an object
equal to everything, a forged report).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tailrace.tasks.base import Example, TaskError
from tailrace.tasks.jsonl import JsonlTask
from tailrace.tasks.sandbox import SandboxConfig
from tailrace.tasks.sandbox.isolated import Contained, run_isolated

DEFAULT_TEMPLATE = "{question}\n\nWrite the solution in Python, in one ```python code block."
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def extract_code(response: str) -> str:
    """The last ```python (or bare ```) block of `response`, closed or cut off; else all of it."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def count_asserts(tests: str) -> int:
    return sum(isinstance(stmt, ast.Assert) for stmt in ast.parse(tests).body)


def run_tests(code: str, tests: str) -> int:
    """How many of `tests`' asserts pass after `code` ran (in the sandboxed child)."""
    namespace = {"__name__": "solution"}
    try:
        exec(compile(code, "<completion>", "exec"), namespace)
    except BaseException:  # noqa: BLE001 — the completion's failure, SystemExit included, fails every test
        return 0
    passed = 0
    for stmt in ast.parse(tests).body:
        try:
            exec(compile(ast.Module([stmt], type_ignores=[]), "<tests>", "exec"), namespace)
        except BaseException:  # noqa: BLE001 — a failing assert, or the completion raising inside one
            if not isinstance(stmt, ast.Assert):
                break
            continue
        passed += isinstance(stmt, ast.Assert)
    return passed


class CodeTask(JsonlTask):
    answer_text = staticmethod(str)  # Example.answer is the tests' source, verbatim
    # every run forks the worker: a worker forked from the trainer copies its whole memory map each
    # time (tens of ms with torch loaded), a spawned one only an interpreter and this module
    reward_start_method = "spawn"

    def __init__(
        self,
        path: str | Path,
        *,
        question_field: str = "prompt",
        answer_field: str = "tests",
        prompt_template: str = DEFAULT_TEMPLATE,
        test_mod: int = 10,
        test_path: str | Path | None = None,
        run_timeout_s: float = 3.0,
        sandbox: SandboxConfig = SandboxConfig(),
    ) -> None:
        """`run_timeout_s`: wall time of one run (keep it under the guard's timeout). `sandbox`: the
        run's limits (cpu_s always; the rest when the task is scored outside a sandboxed worker,
        inline, where each run enters a sandbox of its own)."""
        if not sys.platform.startswith("linux"):
            raise TaskError(f"code tasks run completions in a Linux sandbox; {sys.platform} has none")
        if run_timeout_s <= 0:
            raise TaskError(f"run_timeout_s must be > 0 seconds, got {run_timeout_s}")
        super().__init__(
            path,
            question_field=question_field,
            answer_field=answer_field,
            prompt_template=prompt_template,
            test_mod=test_mod,
            test_path=test_path,
        )
        self.name = f"code:{Path(path).stem}"
        self.run_timeout_s, self.sandbox = run_timeout_s, sandbox
        for split, rows in self.rows.items():
            for ex in rows:
                self._check_tests(split, ex)

    def _check_tests(self, split: str, ex: Example) -> None:
        where = f"{self.name}: the tests of {split} row {ex.id}"
        try:
            n = count_asserts(ex.answer)
        except SyntaxError as e:
            raise TaskError(f"{where} do not parse ({e.msg}, line {e.lineno}); fix the Python") from None
        if n == 0:
            raise TaskError(f"{where} have no top-level assert; write each test as an assert statement")

    def reward(self, example: Example, response: str) -> float:
        total = count_asserts(example.answer)
        passed = run_isolated(
            run_tests, (extract_code(response), example.answer), self.sandbox, self.run_timeout_s
        )
        if type(passed) is not int or not 0 <= passed <= total:  # the child's report is data
            raise Contained(f"reported {str(passed)[:40]} passed of {total} tests")
        return passed / total
