import pytest

from tailrace.records import Finished, Opened, dumps
from tailrace.sim.lengths import ConstantLengths, EmpiricalLengths, LognormalLengths, make_lengths
from tailrace.types import Finish, GenResult, Prompt, Trajectory


def test_lognormal_is_a_pure_function_of_seed_prompt_and_index():
    a = LognormalLengths(median=500, max_len=4000, runaway=0.05, seed=3)
    b = LognormalLengths(median=500, max_len=4000, runaway=0.05, seed=3)
    assert [a.response(p, i) for p in range(50) for i in range(4)] == [
        b.response(p, i) for p in range(50) for i in range(4)
    ]
    assert [a.response(p, 0) for p in range(50)] != [
        LognormalLengths(500, 4000, seed=4).response(p, 0) for p in range(50)
    ]


def test_lognormal_tail_truncation_and_intra_prompt_spread():
    m = LognormalLengths(median=400, max_len=8000, sigma_prompt=0.8, sigma_sample=0.5, runaway=0.05, seed=0)
    xs = sorted(m.response(p, i) for p in range(2000) for i in range(4))
    p50 = xs[len(xs) // 2]
    assert 300 < p50 < 550 and max(xs) == 8000 and min(xs) >= 1
    frac = sum(x == 8000 for x in xs) / len(xs)  # runaways plus the lognormal's own mass above the cap
    assert 0.05 <= frac < 0.08
    # samples of one prompt share its difficulty: within-prompt spread is smaller than across prompts
    within = [abs(m.response(p, 0) - m.response(p, 1)) for p in range(500)]
    across = [abs(m.response(p, 0) - m.response(p + 500, 0)) for p in range(500)]
    assert sum(within) < sum(across)


def _journal(tmp_path, groups):
    lines = []
    for g, lens in enumerate(groups):
        prompt = Prompt(g, (1,) * (5 + g), "")
        lines.append(dumps(Opened(g, 0, g + 1, False, prompt)))
        for i, n in enumerate(lens):
            finish = Finish.LENGTH if n == 64 else Finish.STOP
            r = GenResult(f"{g}.{i}.0", (7,) * n, (-1.0,) * n, (0,) * n, finish)
            lines.append(dumps(Finished(Trajectory(g, i, g, prompt.token_ids, r, 0.0, False))))
    (tmp_path / "journal.jsonl").write_text("\n".join(lines) + "\n{torn")
    return tmp_path


def test_empirical_replays_recorded_lengths_prompt_by_prompt(tmp_path):
    run = _journal(tmp_path, [[3, 9, 64], [20, 21]])
    m = EmpiricalLengths.from_run(run)
    assert m.max_len == 64 and m.prompt_len(0) == 5 and m.prompt_len(1) == 6
    assert [m.response(0, i) for i in range(4)] == [3, 9, 64, 3]
    assert [m.response(3, i) for i in range(2)] == [20, 21]  # prompts cycle through the recorded groups
    assert m.mean() == pytest.approx((3 + 9 + 64 + 20 + 21) / 5)
    assert make_lengths({"kind": "empirical", "run_dir": str(run)}).response(1, 0) == 20


def test_make_lengths_rejects_unknown_kinds_and_bad_values():
    with pytest.raises(ValueError, match="kind"):
        make_lengths({"kind": "pareto"})
    with pytest.raises(ValueError):
        LognormalLengths(median=0, max_len=10)
    assert ConstantLengths(50, max_len=20).response(0, 0) == 20
