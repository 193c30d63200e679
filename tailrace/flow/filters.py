"""The store's entry filter: which complete groups go on to training, and which leave untrained for
fresh prompts in their place.

Two tests, in order: zero-signal (`flow.zero_signal=replace`: every reward equal, no advantage: DAPO's
dynamic sampling) and the user's own (`store.filter`: a function `keep(prompt, samples) -> bool`, as
slime's dynamic-sampling filter and verl's filter_groups). A group either test rejects leaves with its
reason (`zero-signal`, `filtered`), its samples counted as discarded with it, and a fresh prompt takes
its place: at most `flow.extra_groups` a step (null = U), past which groups are trained as they are, so
a filter that rejects everything slows a run by the allowance and never stalls it.

The user's function is asked once per group (its verdict kept on the group), with the group's prompt
(`.id`, `.text`, `.token_ids`, `.answer`) and its samples (`.reward`, `.correct`, `.length`,
`.truncated`, `.result.token_ids`). It must return a bool; one that raises or returns anything else
stops the run with one line naming it (exit 2), everything produced kept for `--resume`.
`store.filter` is `module:function` (the module importable: on PYTHONPATH or in the working directory)
or `path/to/file.py:function`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tailrace.common import InputError
from tailrace.flow.store import GroupState
from tailrace.types import Prompt, Trajectory
from tailrace.user_code import load_function

Keep = Callable[[Prompt, list[Trajectory]], bool]


@dataclass(frozen=True)
class EntryFilter:
    zero_signal: bool = False  # flow.zero_signal=replace
    keep: Keep | None = None  # store.filter, loaded
    name: str = ""  # store.filter as written, for messages

    @property
    def active(self) -> bool:
        return self.zero_signal or self.keep is not None

    def reason(self, g: GroupState) -> str | None:
        """Why complete group `g` must leave untrained (`zero-signal`, `filtered`), or None."""
        if self.zero_signal and g.zero_signal:
            return "zero-signal"
        if self.keep is None:
            return None
        if g.kept is None:
            g.kept = self._ask(g)
        return None if g.kept else "filtered"

    def _ask(self, g: GroupState) -> bool:
        where = f"group {g.id} (prompt {g.prompt.id})"
        try:
            kept = self.keep(g.prompt, list(g.done))
        except Exception as e:
            raise InputError(
                f"store.filter={self.name} raised {type(e).__name__}: {e} on {where}; fix the function and "
                "continue with --resume (everything so far is kept)"
            ) from e
        if not isinstance(kept, bool):
            raise InputError(
                f"store.filter={self.name} returned {kept!r} on {where}, not True (keep) or False (drop); fix "
                "the function and continue with --resume (everything so far is kept)"
            )
        return kept


def load_keep(spec: str) -> Keep:
    """The function `spec` (store.filter) names: `module:function` or `path/to/file.py:function`."""
    return load_function(spec, "store.filter")
