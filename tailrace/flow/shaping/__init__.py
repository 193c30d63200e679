"""Shaping: the response-length distribution a run generates and trains on, on top of any overlap
mode (flow.mode). Each shaping is a small class the scheduler core consults (base.py)."""

from tailrace.flow.shaping.april import April
from tailrace.flow.shaping.base import Plan, Shaping
from tailrace.flow.shaping.darts import Darts
from tailrace.flow.shaping.sortedrl import SortedRL
from tailrace.flow.shaping.tailbatch import TailBatch

SHAPINGS: dict[str, type[Shaping]] = {
    "none": Shaping,
    "darts": Darts,
    "tailbatch": TailBatch,
    "april": April,
    "sorted": SortedRL,
}


def make_shaping(name: str = "none", **options) -> Shaping:
    """Build the shaping `name` (shaping.name); each takes the options it understands."""
    if name not in SHAPINGS:
        raise ValueError(f"unknown shaping.name {name!r}; use one of {', '.join(SHAPINGS)}")
    return SHAPINGS[name].from_options(**options)


def check_mode(name: str, mode: str) -> None:
    """Reject a shaping on an overlap mode it does not support (tailbatch cuts sync's rounds)."""
    if mode == "external" and name != "none":
        raise ValueError(
            f"shaping.name={name} shapes the groups a run makes; with flow.mode=external the agent makes "
            "them (it chooses which completions to send): set shaping.name=none"
        )
    modes = SHAPINGS[name].modes if name in SHAPINGS else None
    if modes is not None and mode not in modes:
        raise ValueError(
            f"shaping.name={name} works with flow.mode={' or '.join(modes)} (its rounds), not {mode}: "
            f"set --flow.mode={modes[0]}, or use shaping.name=darts, which works with every mode"
        )


__all__ = ["SHAPINGS", "Plan", "Shaping", "check_mode", "make_shaping"]
