"""Any reasoning-gym dataset as a Task, scored by the dataset's own `score_answer`.

Splits: examples are generated in fixed-size blocks, each a dataset built with a seed derived from
(split, seed, block); a question belongs to the test split iff a hash of its text says so, so the two
splits never share a question, however small the dataset's question space.

`Example.answer` is a ground-truth handle, not the answer text: JSON {"gold", "seed", "index"}. Many
datasets score with the entry's metadata (countdown checks the numbers used, sudoku the givens), so
the reward rebuilds the entry from (seed, index) — in whichever process it runs. `gold(example)`
gives the dataset's answer text (None where many answers are valid).
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from tailrace.tasks.base import (
    Example,
    Task,
    TaskError,
    check_config,
    check_split,
    in_test_split,
    stable_hash,
)

DEFAULT_SUFFIX = "\n\nGive your final answer on the last line, as 'Answer: <answer>'."
LIST_HINT = 'list them with: python -c "from tailrace.tasks.gym import gym_names; print(*gym_names())"'


def gym_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def extract_answer(response: str, tag: str | None = "answer", marker: str | None = "Answer:") -> str:
    """The text inside the last <tag></tag>, else after the last `marker`, else the whole response;
    stripped. A disabled (None) form is not looked for."""
    if tag:
        close = response.rfind(f"</{tag}>")
        if close >= 0:
            start = response.rfind(f"<{tag}>", 0, close)
            if start >= 0:
                return response[start + len(tag) + 2 : close].strip()
    if marker:
        at = response.rfind(marker)
        if at >= 0:
            return response[at + len(marker) :].strip()
    return response.strip()


class ReasoningGymTask(Task):
    def __init__(
        self,
        dataset: str,
        *,
        config: dict[str, Any] | None = None,
        suffix: str = DEFAULT_SUFFIX,
        answer_tag: str | None = "answer",
        answer_marker: str | None = "Answer:",
        test_mod: int = 8,
        block: int = 256,
    ) -> None:
        """`config` (task.config): the dataset's own config fields (e.g. {"min_terms": 2}), passed to
        create_dataset; its `size` sets `block`, its `seed` is not the user's (each block derives
        one from task.seed). 1 question in `test_mod` (by hash) is test. `block`: items per generated
        dataset; part of the handle's meaning, so changing it changes which entry a handle names."""
        names = gym_names()
        if dataset not in names:
            close = difflib.get_close_matches(dataset, names, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise TaskError(f"unknown reasoning-gym dataset {dataset!r}; {hint}{LIST_HINT}")
        self.name = f"gym:{dataset}"
        if config and "seed" in config:
            raise TaskError(
                f"{self.name}: task.config seed is derived per block from task.seed; set task.seed"
            )
        config = check_config(self.name, config or {}, _config_keys(dataset))
        block = config.pop("size", block)  # reasoning-gym's size: the items of one generated dataset
        if test_mod < 2 or not isinstance(block, int) or block < 1:
            raise TaskError(
                f"gym:{dataset}: test_mod must be >= 2 and block (task.config size) an integer >= 1 "
                f"(got test_mod={test_mod}, block={block})"
            )
        self.dataset = dataset
        self.config = config
        self.suffix, self.answer_tag, self.answer_marker = suffix, answer_tag, answer_marker
        self.test_mod, self.block = test_mod, block
        self._datasets: dict[int, Any] = {}  # block seed -> dataset; both caches are bounded
        self._entries: dict[tuple[int, int], dict] = {}  # (block seed, index) -> entry
        self._dataset(0)  # fail now, not in a rollout, on a bad config

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_datasets": {}, "_entries": {}}  # datasets need not pickle

    # -- generation ---------------------------------------------------------------------------
    def _dataset(self, seed: int):
        """One generated block. An entry is a function of (config, seed, size, index) — checked for
        every dataset of reasoning-gym 0.1.25; a few (acre) depend on size — so a handle names the
        same entry in any process."""
        if seed not in self._datasets:
            _evict(self._datasets, 64)
            self._datasets[seed] = _create(self.dataset, self.config, seed, self.block)
        return self._datasets[seed]

    def _entry(self, seed: int, index: int) -> dict:
        key = (seed, index)
        if key not in self._entries:
            _evict(self._entries, 4096)
            self._entries[key] = self._dataset(seed)[index]
        return self._entries[key]

    def _block_seed(self, split: str, seed: int, block: int) -> int:
        return stable_hash(f"{self.dataset}/{split}/{seed}/{block}")

    def examples(self, split: str, n: int, seed: int = 0) -> list[Example]:
        check_split(split)
        want_test = split == "test"
        out: list[Example] = []
        limit = max(4096, 32 * self.test_mod * n)  # items to try before calling the space too small
        tried, b = 0, 0
        while len(out) < n:
            if tried >= limit:
                raise TaskError(
                    f"{self.name}: found only {len(out)} of {n} {split} examples in "
                    f"{tried} generated; the question space is too small — ask for "
                    f"fewer or widen the dataset config"
                )
            bseed = self._block_seed(split, seed, b)
            for i in range(self.block):
                entry = self._entry(bseed, i)
                tried += 1
                if in_test_split(entry["question"], self.test_mod) != want_test:
                    continue
                handle = json.dumps({"gold": entry["answer"], "seed": bseed, "index": i}, default=str)
                out.append(Example(id=len(out), question=entry["question"] + self.suffix, answer=handle))
                if len(out) == n:
                    break
            b += 1
        return out

    # -- reward -------------------------------------------------------------------------------
    @staticmethod
    def gold(example: Example) -> str | None:
        return json.loads(example.answer)["gold"]

    def reward(self, example: Example, response: str) -> float:
        handle = json.loads(example.answer)
        entry = self._entry(handle["seed"], handle["index"])
        answer = extract_answer(response, self.answer_tag, self.answer_marker)
        return float(self._dataset(handle["seed"]).score_answer(answer, entry))


def _config_keys(name: str) -> list[str]:
    """The fields of the dataset's config class but `seed` (derived per block from task.seed)."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    return [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name != "seed"]


def _evict(cache: dict, cap: int) -> None:
    if len(cache) >= cap:
        del cache[next(iter(cache))]  # oldest insertion first


def _create(name: str, config: dict[str, Any], seed: int, size: int):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        fix = "fix the values' types" if isinstance(e, TypeError) else "fix the config values"
        raise TaskError(f"gym:{name}: bad config {config}: {msg}; {fix}") from None
