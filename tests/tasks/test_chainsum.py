import random

from tailrace.runtime.metrics import percentile
from tailrace.tasks.chainsum import ChainSumTask, final_answer, parse_terms, question


def test_reward_checks_the_final_answer_line_exactly():
    t = ChainSumTask()
    ex = t.examples("train", 1)[0]
    good = t.demonstration(ex, random.Random(0))
    assert t.reward(ex, good) == 1.0
    assert t.reward(ex, good.replace(f"A:{ex.answer}", f"A:{int(ex.answer) + 1}")) == 0.0
    assert t.reward(ex, "no answer here") == 0.0
    assert final_answer("1+2=3\nA:3\n") == "3" and final_answer("A:1\nA:7") == "7"


def test_demonstrations_compute_the_sum_step_by_step():
    t = ChainSumTask()
    rng = random.Random(1)
    for ex in t.examples("train", 200):
        demo = t.demonstration(ex, rng)
        terms = parse_terms(ex.question)
        steps = [ln for ln in demo.splitlines() if "=" in ln and not ln.startswith("ck:")]
        assert len(steps) == len(terms) - 1
        assert int(final_answer(demo)) == sum(terms)


def test_slipped_demonstrations_carry_an_off_by_one_sum_to_a_wrong_answer():
    from dataclasses import replace

    t = ChainSumTask(replace(ChainSumTask().spec, p_slip=0.3))
    rng, wrong = random.Random(2), 0
    for ex in t.examples("train", 200):
        demo = t.demonstration(ex, rng)
        terms = parse_terms(ex.question)
        steps = [ln.split(":", 1)[1] for ln in demo.splitlines() if "=" in ln and not ln.startswith("ck:")]
        total = terms[0]
        for step, term in zip(steps, terms[1:]):
            left, new = step.split("=")
            assert left == f"{total}+{term}"  # each step starts from the total carried so far
            assert abs(int(new) - (total + term)) <= 1
            total = int(new)
        assert int(final_answer(demo)) == total
        wrong += t.reward(ex, demo) == 0.0
    assert 40 < wrong < 180  # slips happen, and long chains collect more of them


def test_splits_are_disjoint_and_deterministic():
    t = ChainSumTask()
    train = {e.question for e in t.examples("train", 3000)}
    test = [e.question for e in t.examples("test", 500)]
    assert not train & set(test)
    assert test == [e.question for e in ChainSumTask().examples("test", 500)]
    assert question([1, 2]) == "Q:a1 b2\n"


def test_demonstration_lengths_are_long_tailed_within_and_across_prompts():
    t = ChainSumTask()
    rng = random.Random(0)
    exs = t.examples("train", 3000)
    lens = [len(t.demonstration(e, rng)) for e in exs]
    assert percentile(lens, 99) / percentile(lens, 50) >= 4
    long = next(e for e in exs if e.question.count(" ") >= 10)
    same = [len(t.demonstration(long, rng)) for _ in range(32)]
    assert max(same) / min(same) >= 1.4  # wandering lines spread one prompt's lengths


def test_a_finite_training_set_comes_back_epoch_after_epoch():
    from itertools import islice

    t = ChainSumTask()
    first = list(islice(t.stream("train", seed=3, size=5), 12))
    assert [e.id for e in first] == [0, 1, 2, 3, 4] * 2 + [0, 1]
    assert first[5:10] == first[:5] == t.examples("train", 5, seed=3)
    fresh = list(islice(t.stream("train", seed=3), 12))
    assert len({e.id for e in fresh}) == 12  # without a size: every prompt new


def test_difficulty_buckets_by_terms_and_accuracy_by_bucket():
    from tailrace.runtime.evaluate import by_bucket
    from tailrace.tasks.base import Example

    task = ChainSumTask()
    assert [task.difficulty(Example(0, question([1] * n), "")) for n in (2, 4, 5, 10, 11, 20)] == [
        "2-4", "2-4", "5-10", "5-10", "11+", "11+",
    ]  # fmt: skip
    got = by_bucket(["11+", "2-4", "5-10", "2-4", None], [True, False, True, True, False])
    assert list(got) == ["2-4", "5-10", "11+"]
    assert got["2-4"] == {"accuracy": 0.5, "n": 2} and got["11+"] == {"accuracy": 1.0, "n": 1}
