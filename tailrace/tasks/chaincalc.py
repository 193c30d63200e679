"""chaincalc: chainsum with a calculator -- the built-in multi-turn tool task.

    prompt:   "Q:a7 b3 c9\n"
    response: "b:[calc:7+3]=10\nc:[calc:10+9]=19\nA:19"        (then <eos>)
                 turn 1   ^obs  turn 2     ^obs   turn 3

The questions and the reward are chainsum's (the final "A:" line, checked exactly); a step may be
worked out in the head ("c:10+9=19", chainsum's way, where slips compound) or asked of the
calculator: the turn ends at "]", the environment answers "=19" (an observation: in the context,
never trained on), and the next turn copies the total on. The warm start's demonstrations use the
calculator in half of them (`P_TOOL`), so the base policy samples both ways and RL finds which pays.
`tools` may add the Python executor (`[py:print(7+3)]`); chainsum's demonstrations never call it.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from tailrace.tasks.base import Example, TaskError, check_config
from tailrace.tasks.chainsum import LETTERS, ChainSumSpec, ChainSumTask, parse_terms
from tailrace.tasks.env import Environment
from tailrace.tasks.tools import TOOLS, Calculator, PythonExecutor

P_TOOL = 0.5  # demonstrations that use the calculator on every step (the others: chainsum's own)


class ChainCalcTask(ChainSumTask, Environment):
    name = "chaincalc"

    def __init__(
        self,
        spec: ChainSumSpec | None = None,
        tools: tuple[str, ...] = ("calc",),
        max_turns: int = 32,
        tool_timeout_s: float = 2.0,
    ) -> None:
        ChainSumTask.__init__(self, spec)
        made = {"calc": Calculator(), "py": PythonExecutor(tool_timeout_s)}
        Environment.__init__(self, {t: made[t] for t in tools}, max_turns)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], max_turns: int) -> ChainCalcTask:
        """chainsum's keys plus `tools` (of calc, py) and `tool_timeout_s` (the Python executor's)."""
        c = check_config("chaincalc", config, ["bands", "max_term", "test_mod", "tools", "tool_timeout_s"])
        tools = tuple(c.pop("tools", ("calc",)))
        bad = [t for t in tools if t not in TOOLS]
        if bad or not tools:
            raise TaskError(f"chaincalc: tools={list(tools)}: choose from {', '.join(TOOLS)}")
        timeout = c.pop("tool_timeout_s", 2.0)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise TaskError(f"chaincalc: tool_timeout_s={timeout!r}: must be > 0 seconds")
        try:
            return cls(ChainSumSpec.from_config(c), tools, max_turns, float(timeout))
        except ValueError as e:
            raise TaskError(f"chaincalc: {e}") from None

    def demonstration(self, ex: Example, rng: random.Random) -> str:
        """A worked answer, observations included (what the calculator would answer)."""
        if rng.random() >= P_TOOL:
            return super().demonstration(ex, rng)
        terms = parse_terms(ex.question)
        lines, total = [], terms[0]
        for i, t in enumerate(terms[1:], start=1):
            lines.append(f"{LETTERS[i]}:[calc:{total}+{t}]={total + t}")
            total += t
        lines.append(f"A:{total}")
        return "\n".join(lines)
