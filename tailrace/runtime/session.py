"""What a run needs besides its processes: model checkpoint, tokenizer, chat format, task, reward guard.

Everything that touches text lives here (and in tasks/, chat.py): prompts are rendered through the
model's chat template (when it has one) and tokenized on the way in, and responses decoded and scored
on the way out; engines and the trainer see token ids only, and stop on `stop_ids`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from tailrace.chat import ChatFormat, TemplateFailed
from tailrace.common import ConfigError
from tailrace.config import RunConfig
from tailrace.config.train import FUSED_TARGETS, LORA_TARGETS
from tailrace.model import fused, lora
from tailrace.model.checkpoint import read_config
from tailrace.model.decoder import CausalLM
from tailrace.model.flat import FlatWeights, flatten_parameters
from tailrace.runtime.warmstart import ensure_warm_start
from tailrace.tasks.base import Example
from tailrace.tasks.env import Environment, Turn
from tailrace.tasks.guard import RewardGuard
from tailrace.tasks.overlong import overlong_penalty
from tailrace.tasks.registry import make_task
from tailrace.tokenizer import load_tokenizer
from tailrace.types import GenResult, Prompt, Scored


class ModelText:
    """A checkpoint's text side: its tokenizer, its chat format (None: raw text) and the token ids
    that end a response -- EOS, the checkpoint's other EOS ids, the chat's end-of-turn token."""

    def __init__(
        self,
        model_path: Path,
        chat_template: str = "auto",
        system_prompt: str | None = None,
        thinking: bool | None = None,
    ):
        self.model_cfg = read_config(model_path)  # fails early, in one line, on a bad checkpoint
        eos = self.model_cfg.eos_token_id  # config.json may list several (Llama 3: eos + end of turn)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or ())
        self.tok = load_tokenizer(model_path, eos_id=eos_ids[0] if eos_ids else None)
        self.chat = self._chat_format(model_path, chat_template, system_prompt, thinking)
        turn_end = [self.chat.end_of_turn] if self.chat and self.chat.end_of_turn is not None else []
        self.stop_ids = tuple(dict.fromkeys([self.tok.eos_id, *eos_ids, *turn_end]))

    def _chat_format(
        self, model_path: Path, mode: str, system: str | None, thinking: bool | None
    ) -> ChatFormat | None:
        if mode == "none":
            return None
        if self.tok.chat_template is None:
            for name, v in (("system_prompt", system), ("thinking", thinking)):
                if v is not None:
                    raise ConfigError(
                        f"task.{name} is set but {model_path} has no chat template "
                        f"(tokenizer_config.json chat_template or chat_template.jinja); drop task.{name}"
                    )
            return None
        return ChatFormat(self.tok, system, thinking)

    def response_text(self, r: GenResult) -> str:
        """A response decoded without the token that stopped it."""
        ids = r.token_ids[:-1] if r.token_ids and r.token_ids[-1] in self.stop_ids else r.token_ids
        return self.tok.decode(ids)


LONG_RUN = 1000  # training prompts in a row too long to take, past which (and past an epoch) a run stops


class Session:
    def __init__(self, cfg: RunConfig, progress=None) -> None:
        self.cfg = cfg
        # cheap checks first: a typo never costs a warm start
        self.task = make_task(
            cfg.task.name,
            cfg.task.config,
            max_turns=cfg.task.max_turns,
            reward=cfg.task.reward,
            reward_weights=cfg.task.reward_weights,
        )
        self.model_path = (
            Path(cfg.model.path)
            if cfg.model.path
            else ensure_warm_start(cfg.arch, cfg.sft, progress, task=cfg.task.name)
        )
        self.text = ModelText(
            self.model_path, cfg.task.chat_template, cfg.task.system_prompt, cfg.task.thinking
        )
        self.model_cfg, self.tok, self.chat = self.text.model_cfg, self.text.tok, self.text.chat
        # the engines' context limit: the run's, else the model's (its sliding window, where shorter)
        self.context = self.model_cfg.context(cfg.rollout.max_context, "rollout.max_context")
        self._check_fused_lora(cfg.train)
        # a multi-turn task's environment: a turn also stops where a tool call ends
        self.env: Environment | None = self.task if isinstance(self.task, Environment) else None
        self.call_id = self._call_id() if self.env is not None else None
        self.stop_ids = self.text.stop_ids + ((self.call_id,) if self.call_id is not None else ())
        self.guard = RewardGuard(self.task, cfg.task.reward_timeout_s)
        self._part_names: tuple[str, ...] = getattr(self.task, "part_names", ())  # task.reward's list
        self._part_sums, self._parts_n = [0.0] * len(self._part_names), 0
        self._examples: dict[int, Example] = {}
        self._longest_prompt: int | None = None  # `expected_context`'s, once measured

    def close(self) -> None:
        self.guard.close()

    def _check_fused_lora(self, train) -> None:
        """Your own trainer's PEFT adapter on a fused model (Phi-3) adapts each fused module whole: the
        run's targets must hold all of a group's projections, or the engines would leave some out."""
        lc = train.lora
        if not (train.external and lc.rank and fused.fused(self.model_cfg)):
            return
        for name, parts in FUSED_TARGETS.items():
            if 0 < len(set(parts) & set(lc.targets)) < len(parts):
                whole = sorted(set(lc.targets) | set(parts), key=LORA_TARGETS.index)
                raise ConfigError(
                    f"train.lora.targets={list(lc.targets)} with train.external on {self.model_cfg.model_type}: "
                    f"PEFT adapts its fused {name} whole ({', '.join(parts)}); set "
                    f"--train.lora.targets=[{', '.join(whole)}]"
                )

    def _call_id(self) -> int:
        ids = self.tok.encode(self.env.call_end)
        if len(ids) != 1:
            raise ConfigError(
                f"task.name={self.cfg.task.name}: its tool calls end with {self.env.call_end!r}, which "
                f"{self.model_path}'s tokenizer writes as {len(ids)} tokens; a turn stops on one token: "
                "use a tokenizer with that text as one token"
            )
        return ids[0]

    def is_call(self, r: GenResult, calls: int) -> bool:
        """The turn stopped at a tool call the environment answers (multi-turn tasks; `calls` answered
        before it): the sample parks for the tool instead of being scored."""
        if self.call_id is None or not r.token_ids or r.token_ids[-1] != self.call_id:
            return False
        return self.env.answers(self.response_text(r), calls)

    def example(self, p: Prompt) -> Example:
        return Example(p.id, p.text, p.answer)

    def turn(self, p: Prompt, r: GenResult, calls: int) -> Turn:
        """The environment's answer to a turn that stopped at a tool call (`is_call`): `r` holds the
        whole response so far; `calls` made before it. Runs the tool: call it off the driver's loop."""
        return self.env.step(self.example(p), self.response_text(r), calls)

    def observation_ids(self, turn: Turn) -> tuple[int, ...]:
        return tuple(self.tok.encode(turn.observation))

    def prompt(self, ex: Example) -> Prompt:
        """The question as token ids: through the chat template when there is one (it writes its own
        special tokens), else BOS + the raw text. `text` stays the question: what the reward sees."""
        if ex.messages:
            ids = self._conversation(ex.messages, ex.id)
        else:
            ids = self.chat.ids(ex.question) if self.chat else self.tok.encode(ex.question, bos=True)
        return Prompt(id=ex.id, token_ids=tuple(ids), answer=ex.answer, text=ex.question)

    def _conversation(self, messages: tuple[tuple[str, str], ...], pid: int) -> list[int]:
        """A chat-message prompt through the chat template as it is; task.system_prompt goes first only
        where the conversation has no system message of its own."""
        if self.chat is None:
            why = (
                "task.chat_template=none"
                if self.cfg.task.chat_template == "none"
                else "the model's tokenizer has none"
            )
            raise ConfigError(
                f"task.name={self.cfg.task.name}: its prompts are chat messages, which need a chat template "
                f"({why}); use a model whose tokenizer has one, with task.chat_template=auto"
            )
        turns = [{"role": r, "content": c} for r, c in messages]
        try:
            return self.tok.encode(self.chat.render_turns(turns, system=messages[0][0] != "system"))
        except TemplateFailed as e:
            roles = "/".join(r for r, _ in messages)
            raise ConfigError(
                f"task.name={self.cfg.task.name}: prompt {pid}'s chat messages ({roles}) fail the model's chat "
                f"template ({e.cause}); make the rows' messages what the template takes (Gemma's, for one, "
                "has no system role)"
            ) from None

    @property
    def max_prompt(self) -> int:
        """The longest prompt a run takes (task.max_prompt_tokens), at most one that leaves its context a
        token to answer with."""
        most = self.context - 1
        return min(most, self.cfg.task.max_prompt_tokens or most)

    def prompt_stream(self) -> Iterator[Prompt]:
        """The training prompts, those longer than `max_prompt` left out (verl's filter_overlong_prompts):
        said once, at the first; a stream of nothing but such prompts is refused. Deterministic, so a
        resume takes the stream where it left it."""
        run, said = 0, False
        for ex in self.task.stream("train", seed=self.cfg.task.seed, size=self.cfg.task.train_size):
            p = self.prompt(ex)
            if len(p.token_ids) <= self.max_prompt:
                run = 0
                yield p
                continue
            run += 1
            if not said:
                print(f"warning: {self._too_long(p)}; such prompts are left out of training", flush=True)
                said = True
            if run >= max(self.cfg.task.train_size or 0, LONG_RUN):
                raise ConfigError(
                    f"task.name={self.cfg.task.name}: {run} training prompts in a row are longer than "
                    f"{self.max_prompt} tokens, the most a prompt may take; {self._fix()}"
                )

    def heldout(self, n: int) -> list[Prompt]:
        """`n` held-out prompts, those longer than `max_prompt` left out (said once; none left: refused)."""
        prompts = [self.prompt(ex) for ex in self.task.examples("test", n, seed=self.cfg.task.seed)]
        kept = [p for p in prompts if len(p.token_ids) <= self.max_prompt]
        if not kept:
            raise ConfigError(
                f"task.name={self.cfg.task.name}: all {len(prompts)} held-out prompts are longer than "
                f"{self.max_prompt} tokens, the most a prompt may take; {self._fix()}"
            )
        if len(kept) < len(prompts):
            long = next(p for p in prompts if len(p.token_ids) > self.max_prompt)
            print(
                f"warning: {self._too_long(long)}; {len(prompts) - len(kept)} of {len(prompts)} held-out "
                "prompts that long are left out of evaluation",
                flush=True,
            )
        return kept

    def _too_long(self, p: Prompt) -> str:
        return (
            f"task.name={self.cfg.task.name}: prompt {p.id} is {len(p.token_ids)} tokens, more than the "
            f"{self.max_prompt} a prompt may take ({self._limit()})"
        )

    def _limit(self) -> str:
        if self.cfg.task.max_prompt_tokens and self.cfg.task.max_prompt_tokens < self.context - 1:
            return "task.max_prompt_tokens"
        return f"a {self.context}-token context, less a token to answer with"

    def _fix(self) -> str:
        if self._limit() == "task.max_prompt_tokens":
            return "raise task.max_prompt_tokens"
        return (
            "shorten the prompts, or use a model of a longer context (or raise rollout.max_context where set)"
        )

    def expected_context(self, max_new_tokens: int) -> int:
        """The most tokens a request of this run holds, for sizing the engines' KV pools: the longest of
        a sample of its prompts (512 training, up to 512 held-out), with a quarter more for prompts the
        sample missed, plus `max_new_tokens`. A longer request still runs (the pool holds one of up to
        every slot's share); it only makes the engine queue or preempt sooner."""
        if self._longest_prompt is None:  # once: the sample is tokenized through the chat template
            examples = self.task.examples("train", 512, seed=self.cfg.task.seed)
            examples += self.task.examples("test", min(self.cfg.eval.n, 512), seed=self.cfg.task.seed)
            self._longest_prompt = min(
                self.max_prompt, max(len(self.prompt(ex).token_ids) for ex in examples)
            )
        longest = self._longest_prompt
        return longest + longest // 4 + max_new_tokens

    def score(self, prompts: list[Prompt], results: list[GenResult]) -> list[Scored]:
        """The reward of each finished result (the guard contains reward code that raises or hangs);
        correct means verified: reward 1 (with a list of reward functions, the first one's)."""
        return self._score(prompts, results)[0]

    def _score(
        self, prompts: list[Prompt], results: list[GenResult]
    ) -> tuple[list[Scored], list[tuple[float, ...]]]:
        """`score`, and each result's reward functions' values (empty tuples: the task has one)."""
        pairs = [(Example(p.id, p.text, p.answer), self.response_text(r)) for p, r in zip(prompts, results)]
        scored = self.guard.score_many(pairs)
        verdict = [(s.parts[0] if s.parts else s.reward) >= 1.0 for s in scored]
        out = [Scored(r.request_id, s.reward, v) for r, s, v in zip(results, scored, verdict)]
        return out, [s.parts for s in scored]

    def take_reward_parts(self) -> dict[str, float]:
        """Each reward function's mean over the responses scored for training since the last call, by
        name (task.reward's list); empty where the task has one reward, or none was scored."""
        sums, n = self._part_sums, self._parts_n
        self._part_sums, self._parts_n = [0.0] * len(self._part_names), 0
        return {name: s / n for name, s in zip(self._part_names, sums)} if n else {}

    def train_scores(self, prompts: list[Prompt], results: list[GenResult]) -> list[Scored]:
        """`score` for training: the task's reward with DAPO's soft overlong punishment added
        (task.overlong_buffer); `correct` stays the task's verdict. Each reward function's values (a
        list in task.reward) are summed for `take_reward_parts`."""
        scores, parts = self._score(prompts, results)
        for got in parts:
            self._part_sums = [a + b for a, b in zip(self._part_sums, got)]
            self._parts_n += bool(got)
        t = self.cfg.task
        if not t.overlong_buffer:
            return scores
        cap = self.cfg.rollout.max_new_tokens
        return [
            replace(
                s,
                reward=s.reward
                + overlong_penalty(len(r.token_ids), cap, t.overlong_buffer, t.overlong_penalty),
            )
            for s, r in zip(scores, results)
        ]

    def difficulty(self, p: Prompt) -> str | None:
        """The task's difficulty bucket of a prompt (None: the task has none)."""
        return self.task.difficulty(Example(p.id, p.text, p.answer))

    def response_text(self, r: GenResult) -> str:
        """The response as the reward sees it: decoded without the token that stopped it."""
        return self.text.response_text(r)

    def flat_layout(self) -> FlatWeights:
        """The layout of what the trainer publishes, computed on the meta device (no memory, no
        weights): the model's parameters, or with `train.lora` its adapter's alone."""
        lora_cfg = self.cfg.train.lora
        with torch.device("meta"):
            model = CausalLM(self.model_cfg)
            if lora_cfg.rank:
                lora.attach(model, lora_cfg)
            return flatten_parameters(model, trainable=bool(lora_cfg.rank))

    def num_params(self) -> int:
        """The model's parameters (a LoRA run's base, without the adapter)."""
        with torch.device("meta"):
            return CausalLM(self.model_cfg).num_parameters()
