"""Entry filters for the trajectory store: `--store.filter=examples/filters.py:informative`.

A filter is keep(prompt, samples) -> bool, asked once per complete group after the zero-signal test
(README, "zero-signal groups"). A group it refuses leaves untrained (discarded, reason `filtered`) and a
fresh prompt takes its place, at most `flow.extra_groups` a step (default: a step's groups); past that,
groups are trained as they come. `prompt`: .id .text .answer .token_ids; each sample: .reward .correct
.length .truncated .result.token_ids.
"""


def informative(prompt, samples):
    """Online difficulty filtering (Bae et al., 2025): train on the prompts the policy solves sometimes,
    not almost always or almost never: a group's pass rate within [0.25, 0.75]."""
    rate = sum(s.correct for s in samples) / len(samples)
    return 0.25 <= rate <= 0.75


def no_truncated(prompt, samples):
    """Drop a group with a response cut at the length cap: its reward says nothing of a finished answer."""
    return not any(s.truncated for s in samples)
