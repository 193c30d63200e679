"""sorted: SortedRL's early updates in a rollout batch (TECHNIQUES.md §6, §11), for sync.

A round (the rollout batch, `over` x R prompts) is handed out as in sync, but the trainer does not wait for
it: every time U of its groups are complete, the first to complete (the short ones) make a train step
that publishes new weights, and engines load them while the round's long samples run on. No new
prompt is admitted until every group of the round is trained. The off-policy cap K
(flow.max_staleness): a group that could no longer be trained within K versions of the trainer is
given up (its samples discarded, reason `shaping`) and its prompt generated again under fresh enough
weights — SortedRL's on-policy variant, which regenerates cached prompts rather than resuming them.
The policy side is flow/policies/sorted.py; this class holds the cache of prompts to regenerate.
"""

from __future__ import annotations

import math

from tailrace.flow.shaping.base import OwnQueue, Plan
from tailrace.types import Prompt


class SortedRL(OwnQueue):
    name = "sorted"
    modes = ("sync",)
    early_updates = True  # the policy trains a round's groups as they complete (flow/policies/sorted.py)

    def __init__(self, over: float = 2.0) -> None:
        super().__init__()
        if not 1 <= over <= 8:
            raise ValueError(f"shaping.over={over}: must lie in [1, 8] (the rollout batch, x R prompts)")
        self.over = over

    @classmethod
    def from_options(cls, over: float = 2.0, **_) -> SortedRL:
        return cls(over)

    def round_open(self, r: int) -> int:
        """The rollout batch: `over` x R prompts (the policy rounds it down to whole steps)."""
        return math.ceil(self.over * r - 1e-9)

    def next_prompt(self, m: int) -> tuple[Prompt, Plan] | None:
        """The given-up prompts first, before any new one."""
        return (self.queue.pop(0), Plan(m, own=True)) if self.queue else None
