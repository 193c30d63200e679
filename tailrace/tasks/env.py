"""The environment protocol of multi-turn tasks: the policy's turns, the tools' observations between them.

An episode is one trajectory. `reset(example)` gives the text the first turn answers (the question);
the policy generates until it ends a tool call (`call_end`, a stop of the turn) or its response; then
`step(example, transcript, calls)` reads the transcript so far (every turn and observation, as text)
and answers with a `Turn`: the observation the context gains, or None when the episode is over. The
reward at the end is the task's own `reward(example, transcript)`, scored like any response (through
the reward guard). Environments are stateless: everything an episode is lies in its transcript, so a
step can run on any thread (tools are slow: the driver runs them in a pool) and a resumed run needs
nothing but its journal.

A tool call is `[name:args]` at the end of a turn; its observation `=answer` (`observe`). A call
that cannot be answered -- an unknown tool, a malformed expression, code that raises or times out --
gets an observation that says so ("=error: ..."), and the episode goes on. A call beyond `max_turns`
ends the episode unanswered (scored as it stands).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from tailrace.tasks.base import Example
from tailrace.tasks.tools import Tool, answer

_CALL = re.compile(r"\[([A-Za-z_]\w*):([^\[\]]*)\]\Z")


@dataclass(frozen=True)
class Turn:
    """What an environment answers a turn with."""

    observation: str | None  # text the context gains (seen by the policy, never trained on); None: done
    tool: str | None = None  # the tool called (None: no call answered)
    error: bool = False  # the call failed: the observation says how


class Environment:
    """Tool calls `[name:args]` answered by `tools`; subclasses are tasks (prompts, reward) as well."""

    call_end = "]"  # ends a tool call: a turn's stop (one token of the model's tokenizer)

    def __init__(self, tools: Mapping[str, Tool], max_turns: int = 32) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}: must be >= 1 (1 = no tool call answered)")
        self.tools, self.max_turns = dict(tools), max_turns

    def reset(self, example: Example) -> str:
        """The text the first turn answers."""
        return example.question

    def observe(self, text: str) -> str:
        """An answer as the context shows it."""
        return f"={text}"

    def answers(self, transcript: str, calls: int) -> bool:
        """Whether `step` answers this turn (cheap: no tool runs): it ends in a call, and a turn is left
        to read the answer in. False: the episode is over, and the reward scores `transcript`."""
        return transcript.endswith(self.call_end) and calls + 1 < self.max_turns

    def step(self, example: Example, transcript: str, calls: int) -> Turn:
        """The answer to the turn that ends `transcript` (the response so far: turns and observations),
        after `calls` tool calls answered in this episode."""
        if not self.answers(transcript, calls):
            return Turn(None)  # the response ended (or no turn is left): the reward decides
        m = _CALL.search(transcript)
        if m is None:
            return Turn(self.observe("error: malformed call; write [tool:args]"), error=True)
        name, args = m.group(1), m.group(2)
        tool = self.tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self.tools))
            return Turn(self.observe(f"error: unknown tool {name!r} (tools: {known})"), error=True)
        text, failed = answer(tool, args)
        return Turn(self.observe(text), name, failed)
