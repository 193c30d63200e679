"""Overlap and shaping policies: each a small class plugged into the scheduler core."""

from tailrace.flow.policies.base import Policy
from tailrace.flow.policies.multiversion import MultiVersionPolicy
from tailrace.flow.policies.offpolicy import AsyncPolicy
from tailrace.flow.policies.partial import PartialPolicy
from tailrace.flow.policies.pipe import PipePolicy
from tailrace.flow.policies.sync import SyncPolicy

POLICIES: dict[str, type[Policy]] = {
    "sync": SyncPolicy,
    "pipe": PipePolicy,
    "async": AsyncPolicy,
    "partial": PartialPolicy,
    "multiversion": MultiVersionPolicy,
}


def make_policy(mode: str, **options) -> Policy:
    """Build the policy for `mode`; each policy takes the options it understands from `options`."""
    if mode not in POLICIES:
        raise ValueError(f"unknown flow.mode {mode!r}; use one of {', '.join(POLICIES)}")
    return POLICIES[mode].from_options(**options)
