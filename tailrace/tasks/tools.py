"""Tools a multi-turn environment lets the policy call: a calculator and a sandboxed Python executor.

A tool takes its argument text and returns its answer text. Whatever goes wrong inside a tool -- a
malformed expression, code that raises, a run past its time limit -- comes back as `ToolError`, which
the environment turns into an observation saying so (`tasks/env.py`): a tool never stops a run.

    Calculator     arithmetic on integers and decimals (+ - * / // % **, parentheses), walked over
                   Python's parse tree node by node: never eval, no names, no calls, bounded powers
    PythonExecutor a snippet run in a fresh child inside the reward sandbox (tasks/sandbox: limits, no
                   network, a private directory), under a wall-clock timeout; its stdout is the answer
"""

from __future__ import annotations

import ast
import contextlib
import io
import math
import operator
import time
from typing import Protocol

from tailrace.tasks.base import stable_hash
from tailrace.tasks.sandbox import SandboxConfig
from tailrace.tasks.sandbox.isolated import Contained, run_isolated

_ANSWER_CHARS = 200  # an observation's length at most: the rest is cut (the policy's context is small)


class ToolError(Exception):
    """The tool could not answer; the message (one line) becomes the observation."""


class Tool(Protocol):
    name: str

    def run(self, args: str) -> str:
        """The answer to `args`, or ToolError."""
        ...


_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    """Arithmetic expressions; integers stay exact, a whole float prints as an integer."""

    name = "calc"

    def __init__(self, max_chars: int = 200, max_exponent: int = 64, max_digits: int = 60) -> None:
        self.max_chars, self.max_exponent, self.max_digits = max_chars, max_exponent, max_digits

    def run(self, args: str) -> str:
        if len(args) > self.max_chars:
            raise ToolError(f"expression longer than {self.max_chars} characters")
        try:
            tree = ast.parse(args.strip(), mode="eval")
        except SyntaxError:
            raise ToolError(f"cannot parse {args.strip()[:40]!r}") from None
        value = self._eval(tree.body)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value) if isinstance(value, int) else f"{value:.6g}"

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > self.max_exponent:
                raise ToolError(f"exponent {b} beyond {self.max_exponent}")
            try:
                out = _BINARY[type(node.op)](a, b)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("overflow") from None
            if isinstance(out, complex):
                raise ToolError("complex result")
            if isinstance(out, int) and len(str(abs(out))) > self.max_digits:
                raise ToolError(f"result beyond {self.max_digits} digits")
            return out
        raise ToolError(f"unsupported {type(node).__name__} (numbers and + - * / // % ** only)")


def _run_snippet(code: str) -> dict:
    """In the sandboxed child: run `code`, return its stdout (and the exception that ended it)."""
    out = io.StringIO()
    error = None
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(code, "<tool>", "exec"), {"__name__": "tool"})
        except BaseException as e:  # noqa: BLE001 -- the snippet's failure is its answer
            error = f"{type(e).__name__}: {e}"
    return {"stdout": out.getvalue()[: 4 * _ANSWER_CHARS], "error": error}


class PythonExecutor:
    """A Python snippet in the reward sandbox (a fresh child per call, `timeout_s` of wall time). Called
    from the driver's tool threads, the child comes from the fork server (`run_isolated`): 75 ms a
    call against 13 ms forked (bench/isolated.py), which a process running other threads must not be."""

    name = "py"

    def __init__(self, timeout_s: float = 2.0, sandbox: SandboxConfig = SandboxConfig(cpu_s=2)) -> None:
        self.timeout_s, self.sandbox = timeout_s, sandbox

    def run(self, args: str) -> str:
        try:
            got = run_isolated(_run_snippet, (args,), self.sandbox, self.timeout_s)
        except Contained as e:
            raise ToolError(f"python {e}") from None
        if not isinstance(got, dict) or not isinstance(got.get("stdout"), str):  # the child's report is data
            raise ToolError("python sent a malformed result")
        if got.get("error"):
            raise ToolError(str(got["error"])[:_ANSWER_CHARS])
        return got["stdout"].strip()


class Delayed:
    """`tool` answering after an exponentially distributed delay of mean `mean_s` (a stand-in for a
    tool served over a network: the latency tail a multi-turn run must hide). The delay is a function
    of the call's text, so a run's tool latencies repeat."""

    def __init__(self, tool: Tool, mean_s: float) -> None:
        self.tool, self.mean_s, self.name = tool, mean_s, tool.name

    def run(self, args: str) -> str:
        u = (stable_hash(f"{self.name}/{args}") + 0.5) / 2**32  # uniform in (0, 1)
        time.sleep(-self.mean_s * math.log(u))
        return self.tool.run(args)


TOOLS = {"calc": Calculator, "py": PythonExecutor}


def answer(tool: Tool, args: str) -> tuple[str, bool]:
    """The tool's answer to `args`, cut to a bounded length, and whether it failed: an error is an
    answer too ("error: ..."), whatever the tool raised."""
    try:
        return tool.run(args)[:_ANSWER_CHARS], False
    except ToolError as e:
        return f"error: {e}"[:_ANSWER_CHARS], True
    except Exception as e:  # noqa: BLE001 -- a tool's own bug is an observation too, never a crash
        return f"error: {type(e).__name__}: {e}"[:_ANSWER_CHARS], True
