"""chainsum: the built-in default task — add a chain of numbers with a scratchpad.

    prompt:   "Q:a7 b3 c9 d5\n"
    response: "b:7+3=10\nc:10+9=19\nd:19+5=24\nA:24"      (then <eos>)

Why this shape (DESIGN.md §6): a tail that survives RL must come from prompts that genuinely need
long derivations. The number of terms is heavy-tailed (most chains are short, a few are long), and
the response needs one line per term, so long prompts need long answers however good the policy.
Intra-prompt spread comes from optional "wandering" lines — restating the next term ("next:d5") or
re-checking a step by subtraction ("ck:19-9=10") — that add length without adding information (and
the subtraction check adds a chance to be confused). Demonstrations choose them at random, so a
warm-started policy samples verbose and concise answers for the same prompt. The reward is an exact
check of the final "A:" line.

Each term carries a letter so a step can find its term by content ("c" -> 9) rather than by counting
positions, which a small character-level model learns in minutes; the running total is carried line
to line, so each step is one small addition whose errors compound over a long chain.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Mapping

from tailrace.tasks.base import Example, Task, TaskError, check_config, check_split, in_test_split


@dataclass(frozen=True)
class ChainSumSpec:
    # number of terms: with these weights, drawn uniformly from each (lo, hi) band
    bands: tuple[tuple[float, int, int], ...] = ((0.55, 2, 4), (0.30, 5, 10), (0.15, 11, 20))
    max_term: int = 9
    p_restate: float = 0.20  # per demonstration: style with "left:" lines
    p_check: float = 0.15  # per demonstration: style with "ck:" lines
    p_line: float = 0.6  # within a verbose style, chance of the extra line at each step
    p_slip: float = 0.0  # demonstrations only: chance that a step's sum is off by one (and carried on)
    test_mod: int = 8  # a question is in the test split iff hash(question) % test_mod == 0

    def __post_init__(self) -> None:
        bands = self.bands
        if not bands or any(len(b) != 3 or not 1 <= b[1] <= b[2] <= len(LETTERS) for b in bands):
            raise TaskError(
                f"chainsum: bands={bands}: each band is [weight, min terms, max terms] with "
                f"1 <= min <= max <= {len(LETTERS)}"
            )
        if any(b[0] < 0 for b in bands) or abs(sum(b[0] for b in bands) - 1) > 1e-6:
            raise TaskError(f"chainsum: bands={bands}: the weights must be >= 0 and sum to 1")
        if self.max_term < 1 or self.test_mod < 2:
            raise TaskError(
                f"chainsum: max_term={self.max_term}, test_mod={self.test_mod}: need max_term >= 1 "
                "and test_mod >= 2"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ChainSumSpec:
        """The spec of task.config: the fields that shape the questions (the others shape only the
        warm start's demonstrations, which the default model's recipe fixes)."""
        c = check_config("chainsum", config, ["bands", "max_term", "test_mod"])
        try:
            if "bands" in c:
                c["bands"] = tuple(tuple(b) for b in c["bands"])
            return cls(**c)
        except TypeError as e:
            raise TaskError(f"chainsum: bad task.config {config}: {e}; fix the value's type") from None


class ChainSumTask(Task):
    name = "chainsum"

    def __init__(self, spec: ChainSumSpec | None = None) -> None:
        self.spec = spec or ChainSumSpec()

    # -- prompts -----------------------------------------------------------------------------
    def _terms(self, rng: random.Random) -> list[int]:
        r, acc = rng.random(), 0.0
        for weight, lo, hi in self.spec.bands:
            acc += weight
            if r <= acc:
                break
        n = rng.randint(lo, hi)
        return [rng.randint(1, self.spec.max_term) for _ in range(n)]

    def examples(self, split: str, n: int, seed: int = 0) -> list[Example]:
        check_split(split)
        rng = random.Random(f"chainsum/{split}/{seed}")
        want_test = split == "test"
        out: list[Example] = []
        while len(out) < n:
            terms = self._terms(rng)
            q = question(terms)
            if in_test_split(q, self.spec.test_mod) == want_test:
                out.append(Example(id=len(out), question=q, answer=str(sum(terms))))
        return out

    # -- demonstrations (for the warm start) --------------------------------------------------
    def demonstration(self, ex: Example, rng: random.Random) -> str:
        terms = parse_terms(ex.question)
        style = rng.random()
        restate = style < self.spec.p_restate
        check = not restate and style < self.spec.p_restate + self.spec.p_check
        lines, total = [], terms[0]
        for i, t in enumerate(terms[1:], start=1):
            if restate and rng.random() < self.spec.p_line:
                lines.append(f"next:{LETTERS[i]}{t}")
            new = total + t
            if rng.random() < self.spec.p_slip:
                new += rng.choice((-1, 1))  # a slip: the demonstration carries the wrong total on
            lines.append(f"{LETTERS[i]}:{total}+{t}={new}")
            if check and rng.random() < self.spec.p_line:
                lines.append(f"ck:{new}-{t}={total}")
            total = new
        lines.append(f"A:{total}")
        return "\n".join(lines)

    # -- reward -------------------------------------------------------------------------------
    def reward(self, example: Example, response: str) -> float:
        return 1.0 if final_answer(response) == example.answer else 0.0

    def difficulty(self, example: Example) -> str:
        """By the chain's terms: 2-4 (short), 5-10, 11+ (the long chains shaping must not lose)."""
        n = len(parse_terms(example.question))
        return "2-4" if n <= 4 else "5-10" if n <= 10 else "11+"


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def question(terms: list[int]) -> str:
    return "Q:" + " ".join(f"{LETTERS[i]}{t}" for i, t in enumerate(terms)) + "\n"


def parse_terms(q: str) -> list[int]:
    return [int(t[1:]) for t in q.strip()[2:].split(" ")]


def final_answer(response: str) -> str | None:
    """The text after the last "A:" marker, up to the end of its line; None when absent."""
    at = response.rfind("A:")
    if at < 0:
        return None
    return response[at + 2 :].split("\n", 1)[0].strip()
