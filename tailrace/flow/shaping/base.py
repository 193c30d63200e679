"""The shaping interface: how many candidates a prompt gets, when its group may stop generating, and
which finished candidates it trains on. Orthogonal to the overlap mode (flow/policies/): the core
consults the run's shaping at the same points whatever policy decides the rest.

    window                  prompts planned together (the core takes that many from the stream)
    plan(prompts, m)        candidates per prompt and whether its group stops early
    enough(group)           the group has what it needs: the core aborts its other candidates
    select(group)           (kept, rest) of a complete group; the rest are discards, reason `shaping`
    observe(group)          a complete group's lengths, before selection (per-prompt statistics)
    state_dict / load_state_dict   what a resume needs (the statistics)

`Shaping` itself (shaping.name=none) is the identity: M candidates, no early stop, every sample trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from tailrace.types import Prompt, Trajectory

if TYPE_CHECKING:
    from tailrace.flow.store import GroupState


@dataclass(frozen=True)
class Plan:
    candidates: int  # samples generated for the prompt (>= the group size)
    early_stop: bool = False  # the group stops at its first group-size non-truncated finishers


class Shaping:
    name = "none"
    window = 1

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

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass
