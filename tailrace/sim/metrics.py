"""Metric helpers for simulated runs: the shared definitions (tailrace/metrics.py) plus the
published systems' own figures: RolloutPipe's rollout-to-train-end window and first dispatch, DORA's
per-step bubble and rollout-only share.
"""

from __future__ import annotations


def merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for t0, t1 in sorted(spans):
        if out and t0 <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t1)
        else:
            out.append([t0, t1])
    return [(a, b) for a, b in out]


def minus_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) minus union(b)."""
    a, b = merge(a), merge(b)
    total, j = 0.0, 0
    for t0, t1 in a:
        cut = 0.0
        while j < len(b) and b[j][1] <= t0:
            j += 1
        k = j
        while k < len(b) and b[k][0] < t1:
            cut += min(t1, b[k][1]) - max(t0, b[k][0])
            k += 1
        total += (t1 - t0) - cut
    return total
