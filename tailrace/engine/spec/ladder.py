"""The draft-length ladder (EfficientRollout): the draft length climbs and descends a fixed ladder
with the measured acceptance, holding each rung a minimum number of rounds (pure Python).

Acceptance here is per draft token: accepted / compared, where a verify that accepts a of g drafts
compared min(a + 1, g) of them (drafts after the first rejection were never judged). That is the
alpha of the expected-length formula in `costs`.
"""

from __future__ import annotations

from dataclasses import dataclass

RUNGS = (5, 7, 9, 11)  # draft lengths
UP, DOWN = 0.94, 0.85  # climb at acceptance >= UP, descend at <= DOWN
HOLD = 2  # rounds a rung is held before it may change


def rungs(lo: int, hi: int) -> tuple[int, ...]:
    """A ladder from draft length `lo` to `hi` in steps of 2 (RUNGS is rungs(5, 11)), `hi` its top."""
    return (*range(lo, hi, 2), hi)


@dataclass(frozen=True)
class Rung:
    index: int = 0  # into rungs
    held: int = 0  # rounds completed on this rung
    rungs: tuple[int, ...] = RUNGS  # the ladder's draft lengths, ascending

    @property
    def gamma(self) -> int:
        return self.rungs[self.index]


def climb(rung: Rung, acceptance: float) -> Rung:
    """The rung after a round with this acceptance: up or down one step once the current rung has
    been held `HOLD` rounds (counting this one), else the same rung one round older."""
    held = rung.held + 1
    if held >= HOLD:
        if acceptance >= UP and rung.index + 1 < len(rung.rungs):
            return Rung(rung.index + 1, 0, rung.rungs)
        if acceptance <= DOWN and rung.index > 0:
            return Rung(rung.index - 1, 0, rung.rungs)
    return Rung(rung.index, held, rung.rungs)
