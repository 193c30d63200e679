"""When checkpoints are written: by steps, by minutes, or by the checkpoint's size."""

from tailrace.runtime.checkpoint import AUTO_BYTES, AUTO_MINUTES, Cadence


def saves(c: Cadence, steps: int, step_s: float) -> list[int]:
    out = []
    for n in range(1, steps + 1):
        if c.due(n, n * step_s):
            c.saved(n, n * step_s)
            out.append(n)
    return out


def test_by_steps_and_by_minutes_and_by_either():
    assert saves(Cadence(3, None), 10, 1.0) == [3, 6, 9]
    assert saves(Cadence(None, 1.0), 10, 25.0) == [3, 6, 9]  # 75 s >= 60 s after the last one
    assert saves(Cadence(4, 1.0), 10, 25.0) == [3, 6, 9]  # whichever comes first
    assert saves(Cadence(2, 1.0), 10, 25.0) == [2, 4, 6, 8, 10]


def test_the_default_follows_the_checkpoints_size():
    small = Cadence.of(None, None, 12 * 800_000)  # the built-in model: a checkpoint of ~10 MB
    assert (small.every, small.minutes) == (1, None)
    large = Cadence.of(None, None, 12 * 7_000_000_000)  # a 7B model: ~84 GB
    assert (large.every, large.minutes) == (None, AUTO_MINUTES)
    assert Cadence.of(None, None, AUTO_BYTES).minutes == AUTO_MINUTES
    assert (Cadence.of(5, None, 1 << 40).every, Cadence.of(None, 2.0, 1).minutes) == (5, 2.0)


def test_counting_starts_where_a_resumed_run_starts():
    c = Cadence(3, None)
    c.saved(7, 0.0)
    assert [n for n in range(8, 14) if c.due(n, 0.0)] == [10, 11, 12, 13]
