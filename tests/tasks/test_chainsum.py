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
