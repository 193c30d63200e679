"""The shaping interface: how many candidates a prompt gets, when its group may stop generating, and
which finished candidates it trains on. Orthogonal to the overlap mode (flow/policies/): the core
consults the run's shaping at the same points whatever policy decides the rest.

    window                  prompts planned together (the core takes that many from the stream)
    plan(prompts, m)        candidates per prompt and whether its group stops early
    enough(group)           the group has what it needs: the core aborts its other candidates
    select(group)           (kept, rest) of a complete group; the rest are discards, reason `shaping`
    observe(group)          a complete group's lengths, before selection (per-prompt statistics)
    observe_steps(...)      an engine report's step counts and busy time, and the engines' slots and
                            number (darts sizes its redundancy from what a step costs)
    observe_train(...)      an optimizer step's samples, trained tokens, the sum of their squared lengths
                            and busy time (what training costs)
    set_overlap(overlapped) whether the mode trains while it generates (a staleness bound > 0)
    state_dict / load_state_dict   what a resume needs (the statistics)

Round-based shapings (tailbatch) also size the rounds of round-based modes (sync) and keep prompts of
their own:

    round_open(R)           groups the next round opens (R; tailbatch: more, or a tail round of R)
    round_keep(R)           complete groups a round trains (None: every group); the rest are deferred
                            (their prompts to `defer`), or carried into the next round (`carries`)
    next_prompt(m)          a prompt of shaping's own (a tail round's), before the stream's, or None
    defer(prompt)           a deferred group's prompt, for a later round
    claim(prompt)           journal replay: the prompt a tail group was opened on leaves the queue

`Shaping` itself (shaping.name=none) is the identity: M candidates, no early stop, every sample trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from tailrace.records import prompt_from_json, prompt_to_json
from tailrace.types import Prompt, Trajectory

if TYPE_CHECKING:
    from tailrace.flow.store import GroupState


@dataclass(frozen=True)
class Plan:
    candidates: int  # samples generated for the prompt (>= the group size)
    early_stop: bool = False  # the group stops at its first group-size non-truncated finishers
    own: bool = (
        False  # a prompt of shaping's own queue (a deferred one in a tail round, ...), not the stream's
    )


class Shaping:
    name = "none"
    window = 1
    modes: tuple[str, ...] | None = None  # the overlap modes it works with (None: every one)
    carries = False  # a round's groups past round_keep are carried into the next round (else deferred)
    early_updates = False  # sync trains a round's groups as they complete (sorted)

    @classmethod
    def from_options(cls, **options) -> Shaping:
        """Build from the run's shaping options; a shaping reads only the ones it has."""
        return cls()

    def plan(self, prompts: Sequence[Prompt], m: int) -> list[Plan]:
        return [Plan(m) for _ in prompts]

    def enough(self, g: GroupState) -> bool:
        return False

    def select(self, g: GroupState) -> tuple[list[Trajectory], list[Trajectory]]:
        return list(g.done), []

    def observe(self, g: GroupState) -> None:
        pass

    def observe_steps(
        self, steps: int, decode_tokens: int, prefill_tokens: int, busy_s: float, slots: int, engines: int
    ) -> None:
        pass

    def observe_train(self, samples: int, tokens: int, squares: int, busy_s: float) -> None:
        pass

    def set_overlap(self, overlapped: bool) -> None:
        pass

    def round_open(self, r: int) -> int:
        return r

    def round_keep(self, r: int) -> int | None:
        return None

    def next_prompt(self, m: int) -> tuple[Prompt, Plan] | None:
        return None

    def defer(self, prompt: Prompt) -> None:
        raise NotImplementedError(f"shaping {self.name} defers no group")

    def claim(self, prompt: Prompt) -> None:
        raise NotImplementedError(f"shaping {self.name} keeps no prompts")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass


class OwnQueue(Shaping):
    """A shaping that keeps prompts of its own: the deferred groups' prompts, oldest first, for a
    later round (its `next_prompt` says when); resumable."""

    def __init__(self) -> None:
        self.queue: list[Prompt] = []

    def defer(self, prompt: Prompt) -> None:
        self.queue.append(prompt)

    def claim(self, prompt: Prompt) -> None:
        i = next((i for i, p in enumerate(self.queue) if p.id == prompt.id), None)
        if i is None:
            raise ValueError(f"prompt {prompt.id} was opened from shaping's queue, but is not in it")
        del self.queue[i]

    def state_dict(self) -> dict:
        return {"queue": [prompt_to_json(p) for p in self.queue]}

    def load_state_dict(self, d: dict) -> None:
        self.queue = [prompt_from_json(p) for p in d.get("queue", [])]
