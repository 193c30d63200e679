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


def make_policy(mode: str, zero_signal: str = "train", extra_groups: int | None = None, **options) -> Policy:
    """Build the policy for `mode`; each policy takes the options it understands from `options`.
    `zero_signal` (flow.zero_signal): "replace" swaps zero-signal groups for fresh prompts, at most
    `extra_groups` per optimizer step (None = U); "train" trains them as they are."""
    if mode not in POLICIES:
        raise ValueError(f"unknown flow.mode {mode!r}; use one of {', '.join(POLICIES)}")
    policy = POLICIES[mode].from_options(**options)
    policy.extra_groups = extra_groups if zero_signal == "replace" else 0
    return policy
