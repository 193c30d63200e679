"""tailbatch: RollPacker's tail batching (TECHNIQUES.md §6), for round-based modes (sync, pipe).

A short round opens ceil(eta x R) prompts with ceil(eta_responses x M) candidates each. A prompt's
group stops at its first M finishers (the core aborts the rest), and the round keeps the first R
groups to complete: the others are deferred — their candidates aborted, their samples discarded
(reason `shaping`) — and their prompts wait in a queue. Once R prompts wait, the next round is a
tail round on them: M candidates each, no cut, everything trained. The long responses that hold a
synchronous round hostage are generated together, in rounds of their own (about one in four in the
paper), instead of in every round.

What is trained is biased the way the paper's is: within a prompt, the first M of its candidates
(the shorter ones); across prompts, the slow ones a round later, under newer weights, never dropped.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tailrace.flow.shaping.base import OwnQueue, Plan
from tailrace.types import Prompt, Trajectory

if TYPE_CHECKING:
    from tailrace.flow.store import GroupState


class TailBatch(OwnQueue):
    name = "tailbatch"
    modes = ("sync", "pipe")

    def __init__(self, eta: float = 1.25, eta_responses: float = 1.25) -> None:
        if not 1 <= eta <= 2:
            raise ValueError(f"shaping.eta={eta}: must lie in [1, 2] (prompts a short round opens, x R)")
        if not 1 <= eta_responses <= 2:
            raise ValueError(
                f"shaping.eta_responses={eta_responses}: must lie in [1, 2] (candidates per prompt, x M)"
            )
        super().__init__()
        self.eta, self.eta_responses = eta, eta_responses
        self.tail_left = 0  # prompts of the tail round being opened still to hand out

    @classmethod
    def from_options(cls, eta: float = 1.25, eta_responses: float = 1.25, **_) -> TailBatch:
        return cls(eta, eta_responses)

    def round_open(self, r: int) -> int:
        if len(self.queue) >= r:
            self.tail_left = r
            return r
        self.tail_left = 0
        return math.ceil(self.eta * r - 1e-9)

    def round_keep(self, r: int) -> int | None:
        return r

    def next_prompt(self, m: int) -> tuple[Prompt, Plan] | None:
        if not self.tail_left:
            return None
        self.tail_left -= 1
        return self.queue.pop(0), Plan(m, own=True)

    def plan(self, prompts, m: int) -> list[Plan]:
        n = math.ceil(self.eta_responses * m - 1e-9)
        return [Plan(n, early_stop=n > m) for _ in prompts]

    def enough(self, g: GroupState) -> bool:
        return g.early_stop and len(g.done) >= g.size

    def select(self, g: GroupState) -> tuple[list[Trajectory], list[Trajectory]]:
        """The first M finishers (the group's samples are in completion order), by sample index."""
        kept, rest = g.done[: g.size], g.done[g.size :]
        return sorted(kept, key=lambda t: t.sample_index), rest
