"""DARTS' dual-end selection: which of a prompt's finished candidates a group trains on.

Pure: trajectories in, (kept, rest) out. A truncated response (finish = length) is no evidence of
how long the answer should be, so it is excluded while enough others finished; the K = M - L
shortest of the rest are kept (the behaviour to reinforce: the correct answers are usually the
short ones) plus the L longest (so the group still sees, and can penalise or reward, long answers).
Ties in length go to the lower sample index among the shortest and the higher among the longest, so
a selection never depends on completion order.
"""

from __future__ import annotations

from typing import Sequence

from tailrace.types import Trajectory


def dual_end(trajs: Sequence[Trajectory], m: int, longest: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """Keep m of `trajs`: the m - longest shortest non-truncated ones and the `longest` longest of the
    remaining non-truncated ones. With fewer than m non-truncated, all of them are kept and the
    shortest truncated fill the group up to m. Returns (kept, rest), each in sample-index order."""
    if not 0 <= longest <= m:
        raise ValueError(f"shaping.longest={longest}: must lie in [0, samples_per_prompt={m}]")
    order = sorted(trajs, key=lambda t: (t.length, t.sample_index))
    ok = [t for t in order if not t.truncated]
    cut = [t for t in order if t.truncated]
    if len(ok) <= m:
        kept = ok + cut[: m - len(ok)]
    else:
        kept = ok[: m - longest] + ok[len(ok) - longest :]
    chosen = {t.sample_index for t in kept}
    rest = [t for t in trajs if t.sample_index not in chosen]
    return sorted(kept, key=lambda t: t.sample_index), sorted(rest, key=lambda t: t.sample_index)
