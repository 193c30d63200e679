"""Shaping: the response-length distribution a run generates and trains on, on top of any overlap
mode (flow.mode). Each shaping is a small class the scheduler core consults (base.py)."""

from tailrace.flow.shaping.base import Plan, Shaping
from tailrace.flow.shaping.darts import Darts

SHAPINGS: dict[str, type[Shaping]] = {"none": Shaping, "darts": Darts}


def make_shaping(name: str = "none", **options) -> Shaping:
    """Build the shaping `name` (shaping.name); each takes the options it understands."""
    if name not in SHAPINGS:
        raise ValueError(f"unknown shaping.name {name!r}; use one of {', '.join(SHAPINGS)}")
    return SHAPINGS[name].from_options(**options)


__all__ = ["SHAPINGS", "Plan", "Shaping", "make_shaping"]
