"""What a run needs besides its processes: model checkpoint, tokenizer, task, reward guard.

Everything that touches text lives here (and in tasks/): prompts are tokenized on the way in, and
responses decoded and scored on the way out; engines and the trainer see token ids only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from tailrace.config import RunConfig
from tailrace.model.checkpoint import read_config
from tailrace.model.decoder import CausalLM
from tailrace.model.flat import FlatWeights, flatten_parameters
from tailrace.runtime.warmstart import ensure_warm_start
from tailrace.tasks.base import Example
from tailrace.tasks.guard import RewardGuard
from tailrace.tasks.registry import make_task
from tailrace.tokenizer import load_tokenizer
from tailrace.types import GenResult, Prompt, Scored


class Session:
    def __init__(self, cfg: RunConfig, progress=None) -> None:
        self.cfg = cfg
        # cheap checks first: a typo never costs a warm start
        self.task = make_task(cfg.task.name, cfg.task.config)
        self.model_path = (
            Path(cfg.model.path) if cfg.model.path else ensure_warm_start(cfg.arch, cfg.sft, progress)
        )
        self.model_cfg = read_config(self.model_path)  # fails early, in one line, on a bad checkpoint
        self.tok = load_tokenizer(self.model_path, eos_id=self.model_cfg.eos_token_id)
        self.guard = RewardGuard(self.task, cfg.task.reward_timeout_s)
        self._examples: dict[int, Example] = {}

    def close(self) -> None:
        self.guard.close()

    def prompt(self, ex: Example) -> Prompt:
        return Prompt(
            id=ex.id,
            token_ids=tuple(self.tok.encode(ex.question, bos=self.tok.bos_id is not None)),
            answer=ex.answer,
            text=ex.question,
        )

    def prompt_stream(self) -> Iterator[Prompt]:
        for ex in self.task.stream("train", seed=self.cfg.task.seed):
            yield self.prompt(ex)

    def heldout(self, n: int) -> list[Prompt]:
        return [self.prompt(ex) for ex in self.task.examples("test", n, seed=self.cfg.task.seed)]

    def score(self, prompts: list[Prompt], results: list[GenResult]) -> list[Scored]:
        """The reward of each finished result (the guard contains reward code that raises or hangs);
        correct means verified: reward 1."""
        pairs = [
            (Example(p.id, p.text, p.answer), self.tok.decode(r.token_ids)) for p, r in zip(prompts, results)
        ]
        scored = self.guard.score_many(pairs)
        return [Scored(r.request_id, s.reward, s.reward >= 1.0) for r, s in zip(results, scored)]

    def flat_layout(self) -> FlatWeights:
        """The trainer's flat-buffer layout, computed on the meta device (no memory, no weights)."""
        with torch.device("meta"):
            return flatten_parameters(CausalLM(self.model_cfg))
