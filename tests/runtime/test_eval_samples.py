"""Held-out evaluation with several samples a prompt: the summary's arithmetic, by hand."""

import pytest

from tailrace.runtime.evaluate import summarize


def test_several_samples_a_prompt_average_to_the_accuracy_and_any_one_to_pass_at_k():
    # 3 prompts x 2 samples, prompt-major: prompt 0 right twice, prompt 1 once, prompt 2 never
    correct = [True, True, False, True, False, False]
    out = summarize([10, 20, 30, 40, 50, 60], correct, samples=2)
    assert out["accuracy"] == pytest.approx(3 / 6)  # the mean over samples: pass@1 with less noise
    assert out["pass_at_k"] == pytest.approx(2 / 3)  # a prompt with any right sample
    assert (out["n"], out["samples"], out["max"], out["mean"]) == (3, 2, 60, 35)


def test_one_sample_a_prompt_is_the_summary_it_always_was():
    out = summarize([10, 20], [True, False])
    assert out["accuracy"] == 0.5 and out["n"] == 2
    assert "pass_at_k" not in out and "samples" not in out
    with pytest.raises(ValueError, match="6 results are not 4 samples of each prompt"):
        summarize([1] * 6, [True] * 6, samples=4)


def test_buckets_count_prompts_and_average_samples():
    from tailrace.runtime.evaluate import by_bucket

    # prompts "2-4" (right, wrong) and "11+" (right, right), 2 samples each
    got = by_bucket(["2-4", "2-4", "11+", "11+"], [True, False, True, True], samples=2)
    assert got == {"2-4": {"accuracy": 0.5, "n": 1}, "11+": {"accuracy": 1.0, "n": 1}}
