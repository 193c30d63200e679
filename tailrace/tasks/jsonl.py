"""A Task over a JSONL file of question/answer rows (GSM8K, MATH and the like), scored by math-verify;
or over a parquet file of the same rows (Hugging Face datasets' and verl's files: a dotted field name
reaches a nested one, e.g. answer_field="reward_model.ground_truth"). A question may be a string or a
list of chat messages (TRL's and verl's conversational prompts).

Rows are read and checked when the task is built, so a bad file fails before a run starts. Without
`test_path`, a row is test iff its question's hash says so (one in `test_mod`): deterministic, order
independent, and duplicate questions never straddle the split. `examples` cycles through a split in
epochs, each reshuffled, so `n` may exceed `size(split)` (then questions repeat).

`Example.answer` is the gold answer text; GSM8K's "reasoning #### 72" becomes "72".
"""

from __future__ import annotations

import json
import random
import re
import threading
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from tailrace.tasks.base import SPLITS, Example, Task, TaskError, check_split, in_test_split

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def gold_text(raw: object) -> str:
    """The answer after the last '####' when present (GSM8K), stripped."""
    text = str(raw)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip()


def math_match(gold: str, response: str) -> bool:
    """math-verify equivalence of `gold` and the answer in `response` (last boxed / 'answer is' /
    last expression; after '####' when present). An unparseable gold falls back to exact text."""
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only the main thread may set; elsewhere rely on
    # the RewardGuard's timeout.
    t = 5 if threading.current_thread() is threading.main_thread() else None
    g = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=t)
    if not g:
        return gold_text(response) == gold
    r = parse(gold_text(response), parsing_timeout=t)
    if not r or _spelled_out(r[-1]):
        return False
    return verify(g, r, timeout_seconds=t)


def _spelled_out(answer: str) -> bool:
    """Arithmetic on number literals alone ("51 + 86 + 38", "3*4"): math-verify takes the last
    expression of a response as its answer and evaluates it, so a response that restates the
    question's sum without computing it verified as correct (seen with SmolLM2-135M on "What is
    51 + 86 + 38?"). A final answer is a value: "1/2", "-7", "x^2+2x+1" and "1+\\sqrt{2}" pass."""
    return bool(_NUMERIC.fullmatch(answer)) and bool(_BINARY_OP.search(answer))


_NUMERIC = re.compile(r"[\d\s.,()+\-*/×·]+")
_BINARY_OP = re.compile(r"\d\)?\s*[-+*×·]\s*\(?\d")


_MISSING = object()


def _field(row: dict, name: str):
    """`row[name]`, or for a dotted name absent as it is the nested value (verl's parquet rows hold the
    answer as reward_model.ground_truth); `_MISSING` when there is none."""
    if name in row:
        return row[name]
    value = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, row) of a .jsonl file (one JSON object a line) or a .parquet file (one row a record, as
    Hugging Face datasets and verl store them; needs pyarrow: pip install 'tailrace[parquet]')."""
    if not path.is_file():
        raise TaskError(
            f"task file not found: {path}; pass the path of a .jsonl file with one JSON object per line, "
            "or of a .parquet file"
        )
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise TaskError(
                f"{path}: reading parquet needs pyarrow: pip install 'tailrace[parquet]'"
            ) from None
        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 -- pyarrow's errors: a damaged or foreign file
            raise TaskError(f"{path}: not a parquet file pyarrow reads ({type(e).__name__}: {e})") from None
        for i, row in enumerate(table.to_pylist()):
            yield f"{path} row {i}", row
        return
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise TaskError(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); re-encode the file as UTF-8"
        ) from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(
                f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one complete JSON object"
            ) from None
        if not isinstance(row, dict):
            raise TaskError(
                f"{where}: expected a JSON object, got {type(row).__name__}; write one {{...}} object per line"
            )
        yield where, row


def _messages(value: list, where: str) -> tuple[tuple[str, str], ...]:
    """A row's chat messages ([{role, content}, ...], TRL's conversational format) as (role, content)
    pairs: roles system, user or assistant, string contents, the last one the user's (the model answers
    it)."""
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ROLES):
            raise TaskError(
                f'{where}: message {i} is {str(m)[:80]}; each must be {{"role": system|user|assistant, '
                '"content": "<text>"}'
            )
        out.append((m["role"], m["content"]))
    if not out or out[-1][0] != "user":
        raise TaskError(f"{where}: the messages must end with the user's (the model answers it); add one")
    return tuple(out)


ROLES = ("system", "user", "assistant")


class JsonlTask(Task):
    answer_text = staticmethod(gold_text)  # a row's answer field -> Example.answer

    def __init__(
        self,
        path: str | Path,
        *,
        question_field: str = "question",
        answer_field: str = "answer",
        prompt_template: str = "{question}",
        test_mod: int = 10,
        test_path: str | Path | None = None,
    ) -> None:
        """`prompt_template`: `{question}` is the question field, `{<field>}` any field of the row;
        other braces (LaTeX) are left alone."""
        if "{question}" not in prompt_template and f"{{{question_field}}}" not in prompt_template:
            raise TaskError(
                f"prompt_template {prompt_template!r} has no {{question}} placeholder; "
                f"add one where the question goes"
            )
        if test_path is None and test_mod < 2:
            raise TaskError(
                f"test_mod must be >= 2 (one question in test_mod is held out), got {test_mod}; "
                f"or pass test_path= for a separate test file"
            )
        self.name = f"{'parquet' if Path(path).suffix == '.parquet' else 'jsonl'}:{Path(path).stem}"
        self.template = prompt_template
        self.fields = (question_field, answer_field)
        rows = self._load(Path(path))
        if test_path is None:  # hash the raw question, so a new template keeps the split
            test = [ex for q, ex in rows if in_test_split(q, test_mod)]
            train = [ex for q, ex in rows if not in_test_split(q, test_mod)]
        else:
            train, test = [ex for _, ex in rows], [ex for _, ex in self._load(Path(test_path))]
        self.rows: dict[str, list[Example]] = {"train": train, "test": test}

    def size(self, split: str) -> int:
        check_split(split)
        return len(self.rows[split])

    def _load(self, path: Path) -> list[tuple[str, Example]]:
        """(raw question, example) per row, in file order."""
        qf, af = self.fields
        out: list[tuple[str, Example]] = []
        for where, row in _rows(path):
            values = {}
            for field, arg in ((qf, "question_field"), (af, "answer_field")):
                values[field] = _field(row, field)
                if values[field] is _MISSING:
                    raise TaskError(
                        f"{where}: missing field {field!r} (has {', '.join(row) or 'none'}); "
                        f"add it, or pass {arg}= naming the right field (a nested one as a.b)"
                    )
            question, answer = values[qf], self.answer_text(values[af])
            if isinstance(question, list):  # a conversation: it goes through the chat template as it is
                messages = _messages(question, f"{where}: {qf!r}")
                if self.template != "{question}":
                    raise TaskError(
                        f"{where}: {qf!r} holds chat messages, which prompt_template={self.template!r} cannot "
                        "wrap; drop prompt_template or write the template's text into the messages"
                    )
                raw = json.dumps(question, sort_keys=True)  # what the test split hashes
                out.append((raw, Example(len(out), messages[-1][1], answer, messages)))
                continue
            values = {**{k: str(v) for k, v in row.items()}, "question": str(question)}
            prompt = _PLACEHOLDER.sub(lambda m: values.get(m[1], m[0]), self.template)
            out.append((values["question"], Example(len(out), prompt, answer)))
        if not out:
            raise TaskError(f"{path}: no rows; add rows with {qf!r} and {af!r} fields")
        return out

    def examples(self, split: str, n: int, seed: int = 0) -> list[Example]:
        check_split(split)
        rows = self.rows[split]
        if not rows:
            other = SPLITS[1 - SPLITS.index(split)]
            raise TaskError(
                f"{self.name}: the {split} split is empty (all {len(self.rows[other])} "
                f"rows hashed to {other}); add rows, change test_mod or pass test_path="
            )
        if split == "test" and n > len(rows):  # held out: each question once, or the resolution is a lie
            warnings.warn(
                f"{self.name}: eval.n={n} but the test split has {len(rows)} questions; evaluating those "
                f"{len(rows)} once each (add rows, lower test_mod or pass test_path= for more)",
                stacklevel=2,
            )
            n = len(rows)
        rng = random.Random(f"jsonl/{split}/{seed}")
        out: list[Example] = []
        while len(out) < n:
            epoch = list(rows)
            rng.shuffle(epoch)
            for ex in epoch[: n - len(out)]:
                out.append(replace(ex, id=len(out)))
        return out

    def reward(self, example: Example, response: str) -> float:
        return 1.0 if math_match(example.answer, response) else 0.0
