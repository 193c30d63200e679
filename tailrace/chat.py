"""A task's question as the model's chat: an optional system message, the question as the user's
turn, then the generation prompt — rendered by transformers' own jinja renderer (sandboxed, with the
globals and filters chat templates expect), the way `apply_chat_template` renders it.

Token ids: the rendered text already holds every special token the template writes (BOS included,
when the template has one), so it is tokenized without adding any, as `apply_chat_template` and
vLLM do — never a second BOS. Stopping: the token that closes an assistant turn (`<|im_end|>` in
ChatML, `<|eot_id|>` in Llama 3) is found by rendering a turn and reading the first token after its
content; generation stops on it as well as on EOS.
"""

from __future__ import annotations

from tailrace.tokenizer import Tokenizer, TokenizerError

_PROBE = "TAILRACEPROBE"  # assistant content the end-of-turn search looks past: one word, no spaces


class TemplateFailed(TokenizerError):
    """The model's chat template raised on a conversation; `cause` says what it raised."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class ChatFormat:
    def __init__(self, tok: Tokenizer, system: str | None = None, thinking: bool | None = None) -> None:
        """`tok` must carry a chat template; `system`: the system message (None: the template's own
        default, if it has one); `thinking`: the template's `enable_thinking` (Qwen3's templates: False
        closes an empty think block after the generation prompt, so the model answers at once; None:
        the template's default). A template that never reads `enable_thinking` refuses a setting."""
        from transformers.utils.chat_template_utils import render_jinja_template  # ~1 s: only here

        assert tok.chat_template is not None
        self.switch = "enable_thinking" in tok.chat_template  # the template reads a thinking switch
        if thinking is not None and not self.switch:
            raise TokenizerError(
                f"task.thinking={str(thinking).lower()} but the model's chat template has no "
                "enable_thinking switch; drop task.thinking"
            )
        self.tok, self.system, self.thinking = tok, system, thinking
        self._render_jinja = render_jinja_template
        self.end_of_turn = self._end_of_turn()

    def render(self, question: str) -> str:
        return self.render_turns([{"role": "user", "content": question}])

    def render_turns(self, turns: list[dict], thinking: bool | None = None, system: bool = True) -> str:
        """A conversation (the system message, if set and `system`, goes first) and the assistant's
        generation prompt: what a chat endpoint sends the model. `thinking`: this conversation's switch
        (None: the format's); the caller checks `switch` first."""
        return self._render(turns, add_generation_prompt=True, thinking=thinking, system=system)

    def ids(self, question: str) -> list[int]:
        return self.tok.encode(self.render(question))

    def _render(
        self,
        turns: list[dict],
        add_generation_prompt: bool,
        thinking: bool | None = None,
        system: bool = True,
    ) -> str:
        system = [{"role": "system", "content": self.system}] if self.system is not None and system else []
        thinking = self.thinking if thinking is None else thinking
        options = {} if thinking is None else {"enable_thinking": thinking}
        try:
            (text,), _ = self._render_jinja(
                [system + turns],
                chat_template=self.tok.chat_template,
                add_generation_prompt=add_generation_prompt,
                **self.tok.special_tokens,
                **options,
            )
        except Exception as e:  # jinja raises TemplateError, or whatever the template's code raises
            fix = "drop task.system_prompt or " if self.system is not None else ""
            cause = f"{type(e).__name__}: {e}"
            raise TemplateFailed(
                f"the model's chat template failed ({cause}); {fix}set task.chat_template=none to send the "
                "question as raw text",
                cause,
            ) from None
        return text

    def _end_of_turn(self) -> int | None:
        turns = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": _PROBE}]
        text = self._render(turns, add_generation_prompt=False)
        after = text[text.rindex(_PROBE) + len(_PROBE) :] if _PROBE in text else ""
        first = self.tok.encode(after)[:1]
        return first[0] if first and first[0] in self.tok.added_ids() else None
