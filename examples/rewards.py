"""Reward functions for `--task.reward=examples/rewards.py:<name>`: the task's prompts and answers,
scored by your function instead of the task's own.

A reward is reward(question, response, answer) -> float: `question` the task's question text,
`response` the model's answer text (the chat template's markup removed), `answer` the task's ground truth
(chainsum's sum, a JSONL row's answer). 1 or more counts as verified correct (held-out accuracy); any
other value is a reward as it is. It runs in the reward guard's sandbox: one that raises or hangs scores 0
with its reason counted, and the run goes on.
"""


def final_answer(response: str) -> str | None:
    at = response.rfind("A:")
    return response[at + 2 :].split("\n", 1)[0].strip() if at >= 0 else None


def sum_then_stop(question, response, answer):
    """chainsum's reward, plus a little for stopping at the answer: 1.1 for a right answer on the last
    line, 1.0 for a right one with more after it, 0.1 for a wrong answer given in the A: format, else 0."""
    got = final_answer(response)
    if got is None:
        return 0.0
    if got != answer:
        return 0.1
    last = response.strip().splitlines()[-1:]
    return 1.1 if last and last[0].startswith("A:") else 1.0
