"""Overlap and shaping policies: each a small class plugged into the scheduler core."""

from tailrace.flow.filters import EntryFilter, Keep
from tailrace.flow.policies.base import Policy
from tailrace.flow.policies.external import ExternalPolicy
from tailrace.flow.policies.multiversion import MultiVersionPolicy
from tailrace.flow.policies.offpolicy import AsyncPolicy
from tailrace.flow.policies.partial import PartialPolicy
from tailrace.flow.policies.pipe import PipePolicy
from tailrace.flow.policies.sync import SyncPolicy
from tailrace.flow.shaping import SHAPINGS

POLICIES: dict[str, type[Policy]] = {
    "sync": SyncPolicy,
    "pipe": PipePolicy,
    "async": AsyncPolicy,
    "partial": PartialPolicy,
    "multiversion": MultiVersionPolicy,
    "external": ExternalPolicy,
}
GROUP_MODES = [m for m, p in POLICIES.items() if not p.external]  # the modes that open their own groups


def make_policy(
    mode: str,
    zero_signal: str = "train",
    extra_groups: int | None = None,
    keep: Keep | None = None,
    keep_name: str = "",
    **options,
) -> Policy:
    """Build the policy for `mode`; each policy takes the options it understands from `options`.
    `zero_signal` (flow.zero_signal): "replace" swaps zero-signal groups for fresh prompts, "train"
    trains them as they are; `keep` (store.filter, loaded; `keep_name` as written) swaps the groups it
    refuses; at most `extra_groups` swaps per optimizer step (None = U)."""
    if mode not in POLICIES:
        raise ValueError(f"unknown flow.mode {mode!r}; use one of {', '.join(POLICIES)}")
    policy = POLICIES[mode].from_options(**options)
    policy.entry = EntryFilter(zero_signal == "replace", keep, keep_name)
    policy.extra_groups = extra_groups if policy.entry.active else 0
    return policy


# flow.mode null: multiversion reached the default task's held-out target in 0.63x sync's wall time at
# the same final accuracy (bench/modes.py, demo config, 3 seeds x 120 steps; the README's table).
RECOMMENDED = "multiversion"


def recommended_mode(
    shaping: str = "none", versions_at_once: int | None = None, pregen: bool = False
) -> tuple[str, str]:
    """The mode a run with flow.mode null gets, and why: the recommended one, or sync where the run
    needs sync's rounds (a shaping that cuts rounds, bubble pre-generation) or its engines hold one
    weight version at a time."""
    modes = SHAPINGS[shaping].modes if shaping in SHAPINGS else None
    if modes is not None and RECOMMENDED not in modes:
        return modes[0], f"shaping.name={shaping} cuts {modes[0]}'s rounds"
    if pregen:
        return "sync", "rollout.spec.pregen_below pre-generates the next round in sync's bubble"
    if versions_at_once == 1:
        return "sync", "the rollout engines hold one weight version at a time"
    return RECOMMENDED, "the best measured wall time to held-out accuracy on the default task"
