"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a response that runs into the last
`buffer` tokens before the length cap loses reward linearly, up to `factor` at the cap itself, so the
policy learns to finish before it is cut off rather than being scored 0 at the cap with no gradient
on its length. Added to the task's reward for training; `correct` and every evaluation see the task's
own reward.
"""

from __future__ import annotations


def overlong_penalty(length: int, cap: int, buffer: int, factor: float = 1.0) -> float:
    """0 up to `cap - buffer` tokens, then -(length - (cap - buffer)) / buffer x factor: -factor at
    `cap` (and past it: a response the context limit cut). `buffer` 0: off."""
    if buffer <= 0 or length <= cap - buffer:
        return 0.0
    return -min(1.0, (length - (cap - buffer)) / buffer) * factor
