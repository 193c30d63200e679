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
from tailrace.tasks.tools import TOOLS, Calculator, Delayed, PythonExecutor

P_TOOL = 0.5  # demonstrations that use the calculator on every step (the others: chainsum's own)


class ChainCalcTask(ChainSumTask, Environment):
    name = "chaincalc"

    def __init__(
        self,
        spec: ChainSumSpec | None = None,
        tools: tuple[str, ...] = ("calc",),
        max_turns: int = 32,
        tool_timeout_s: float = 2.0,
        tool_latency_s: float = 0.0,
    ) -> None:
        """`tool_latency_s`: the mean of an added delay per call (exponential; 0 = none), to see tool
        latency as a source of tail."""
        ChainSumTask.__init__(self, spec)
        made = {"calc": Calculator(), "py": PythonExecutor(tool_timeout_s)}
        chosen = {t: made[t] for t in tools}
        if tool_latency_s > 0:
            chosen = {t: Delayed(tool, tool_latency_s) for t, tool in chosen.items()}
        Environment.__init__(self, chosen, max_turns)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], max_turns: int) -> ChainCalcTask:
        """chainsum's keys plus `tools` (of calc, py), `tool_timeout_s` (the Python executor's) and
        `tool_latency_s` (a mean delay added to every call)."""
        keys = ["bands", "max_term", "test_mod", "tools", "tool_timeout_s", "tool_latency_s"]
        c = check_config("chaincalc", config, keys)
        tools = tuple(c.pop("tools", ("calc",)))
        bad = [t for t in tools if t not in TOOLS]
        if bad or not tools:
            raise TaskError(f"chaincalc: tools={list(tools)}: choose from {', '.join(TOOLS)}")
        timeout, latency = c.pop("tool_timeout_s", 2.0), c.pop("tool_latency_s", 0.0)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise TaskError(f"chaincalc: tool_timeout_s={timeout!r}: must be > 0 seconds")
        if not isinstance(latency, (int, float)) or latency < 0:
            raise TaskError(f"chaincalc: tool_latency_s={latency!r}: must be >= 0 seconds")
        try:
            return cls(ChainSumSpec.from_config(c), tools, max_turns, float(timeout), float(latency))
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
