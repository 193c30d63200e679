"""The OpenAI wire format of `tailrace serve`: request bodies in, engine requests out; engine results
in, response bodies and stream chunks out. Pure: no engine, no sockets.

Both endpoints (`/v1/completions`, `/v1/chat/completions`) take `max_tokens`, `temperature`,
`top_p`, `n`, `seed`, `stream` and `logprobs` as OpenAI defines them, plus tailrace's `top_k`,
`min_tokens` and `stop_token_ids`. A prompt is a string or a list of token ids. What a trainer needs
comes with every choice, whether asked for or not: `token_ids`, `token_logprobs` (the sampled
token's log-probability under the distribution it was sampled from: after temperature, top-k,
top-p) and `token_versions` (the policy version that produced each token), and the response's
`policy_version`, and each choice its `completion_id` (which names it in a group sent back to a
training run: `POST /v1/groups`, `parse_group`). Only the sampled token's log-probability exists:
`top_logprobs` above 0 is refused.
Stop strings are not supported (a request with `stop` is refused: use `stop_token_ids`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tailrace.types import Finish, GenResult, SamplingParams

FINISH = {Finish.STOP: "stop", Finish.LENGTH: "length", Finish.ABORTED: "abort"}


class ApiError(Exception):
    """A request the endpoint refuses: HTTP `status`, and a message that names the field and the fix."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Parsed:
    """One request body, checked: the prompt's token ids, the sampling of each of its `n` choices."""

    prompt_ids: tuple[int, ...]
    params: tuple[SamplingParams, ...]  # one per choice
    stream: bool
    chat: bool


def parse(
    body: Any,
    chat: bool,
    encode: Callable[[str], list[int]],
    render: Callable[[list[dict]], list[int]] | None,
    stop_ids: tuple[int, ...],
    max_tokens: int,
    vocab: int,
    context: int,
    sampling: SamplingParams | None = None,
) -> Parsed:
    """Check a body of either endpoint. `encode`: text -> token ids (a completion's prompt);
    `render`: messages -> token ids through the chat template (None: the model has none); `context`:
    the most tokens a request may hold; `sampling`: a training run's temperature, top-p and top-k, the
    defaults and the only values taken (None: any, defaults 1, 1, 0)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    if "stop" in body and body["stop"] not in (None, [], ""):
        raise ApiError(
            "stop strings are not supported; pass stop_token_ids (token ids) instead", param="stop"
        )
    if chat:
        ids = _messages(body.get("messages"), render, _thinking(body.get("chat_template_kwargs")))
        if body.get("top_logprobs") not in (None, 0):
            raise ApiError(
                "top_logprobs: only the sampled token's logprob exists; use 0", param="top_logprobs"
            )
    else:
        ids = _prompt(body.get("prompt"), encode, vocab)
        if body.get("logprobs") not in (None, 0, 1) or isinstance(body.get("logprobs"), bool):
            raise ApiError("logprobs: only the sampled token's logprob exists; use 0 or 1", param="logprobs")
    n = _int(body, "n", 1, 1, 64)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError("seed: must be an integer", param="seed")
    stops = body.get("stop_token_ids", [])
    if not isinstance(stops, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in stops):
        raise ApiError(f"stop_token_ids: must be a list of token ids in [0, {vocab})", param="stop_token_ids")
    base = sampling or SamplingParams()
    if sampling is not None:
        for key, own in (("temperature", base.temperature), ("top_p", base.top_p), ("top_k", base.top_k)):
            if body.get(key) is not None and body.get(key) != own:
                raise ApiError(
                    f"{key}={body.get(key)!r}: this endpoint serves a training run, which samples at "
                    f"rollout.{key}={own} (its trainer's ratios assume it); omit {key} or send {own}",
                    param=key,
                )
    try:
        params = tuple(
            SamplingParams(
                temperature=_float(body, "temperature", base.temperature),
                top_p=_float(body, "top_p", base.top_p),
                top_k=_int(body, "top_k", base.top_k, 0, None),
                min_new_tokens=_int(body, "min_tokens", 0, 0, None),
                max_new_tokens=_int(body, "max_tokens", max_tokens, 1, None),
                stop_token_ids=tuple(dict.fromkeys([*stop_ids, *stops])),
                seed=None if seed is None else seed + i,
            )
            for i in range(n)
        )
    except ValueError as e:  # SamplingParams names the field and the fix
        raise ApiError(str(e)) from None
    want = len(ids) + params[0].max_new_tokens
    if want > context:
        raise ApiError(
            f"the prompt ({len(ids)} tokens) and max_tokens ({params[0].max_new_tokens}) make {want} tokens, "
            f"more than this server's context of {context} (serve.context): ask for fewer",
            param="max_tokens",
        )
    return Parsed(tuple(ids), params, bool(body.get("stream", False)), chat)


def parse_group(body: Any) -> tuple[list[str], list, list | None]:
    """A group's body: {"completions": [completion ids], "rewards": [numbers], "correct": [bools]
    (optional; default reward > 0)}. The run checks the rest (one prompt, the group size, each once)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    ids, rewards, correct = body.get("completions"), body.get("rewards"), body.get("correct")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ApiError("completions: a non-empty list of completion ids (each choice's completion_id)",
                       param="completions")  # fmt: skip
    if not isinstance(rewards, list):
        raise ApiError("rewards: a list of numbers, one per completion", param="rewards")
    if correct is not None and (
        not isinstance(correct, list)
        or len(correct) != len(ids)
        or not all(isinstance(c, bool) for c in correct)
    ):
        raise ApiError("correct: a list of booleans, one per completion (or omit it)", param="correct")
    return ids, rewards, correct


def response(
    rid: str, model: str, created: int, p: Parsed, results: list[GenResult], text: Callable[[GenResult], str]
) -> dict:
    """The whole response of a finished request (results in choice order)."""
    choices = []
    for i, r in enumerate(results):
        c: dict[str, Any] = {"index": i, "finish_reason": FINISH[r.finish], **_trained(r)}
        if p.chat:
            c["message"] = {"role": "assistant", "content": text(r)}
            c["logprobs"] = None
        else:
            c["text"] = text(r)
            c["logprobs"] = {"token_logprobs": list(r.logprobs), "tokens": None, "top_logprobs": None}
        choices.append(c)
    done = sum(len(r.token_ids) for r in results)
    return {
        "id": rid, "object": "chat.completion" if p.chat else "text_completion", "created": created,
        "model": model, "choices": choices, "policy_version": _version(results),
        "prompt_token_ids": list(p.prompt_ids),
        "usage": {"prompt_tokens": len(p.prompt_ids), "completion_tokens": done,
                  "total_tokens": len(p.prompt_ids) + done},
    }  # fmt: skip


def chunk(rid: str, model: str, created: int, p: Parsed, index: int, delta: str, new: GenResult | None,
          finish: Finish | None) -> dict:  # fmt: skip
    """One stream event: choice `index`'s new text, and (in `new`) only the tokens not sent before."""
    c: dict[str, Any] = {"index": index, "finish_reason": None if finish is None else FINISH[finish]}
    c.update(
        _trained(new) if new is not None else {"token_ids": [], "token_logprobs": [], "token_versions": []}
    )
    if p.chat:
        c["delta"] = {"role": "assistant", "content": delta}
    else:
        c["text"] = delta
    return {
        "id": rid, "object": "chat.completion.chunk" if p.chat else "text_completion", "created": created,
        "model": model, "choices": [c], "policy_version": _version([new] if new else []),
    }  # fmt: skip


class Delta:
    """The text of one choice as it grows: each call gives the part not given before, holding back a
    trailing partial UTF-8 character (decoded as U+FFFD) until its next token completes it."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.sent = decode, ""

    def __call__(self, ids: list[int], final: bool = False) -> str:
        text = self.decode(ids)
        if not final and text.endswith("\ufffd"):
            text = text[:-1]
        new = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = text if text.startswith(self.sent) else self.sent
        return new


def _trained(r: GenResult) -> dict:
    return {
        "completion_id": r.request_id,  # names it in a group sent back to a training run (/v1/groups)
        "token_ids": list(r.token_ids),
        "token_logprobs": list(r.logprobs),
        "token_versions": list(r.versions),
    }


def _version(results: list[GenResult]) -> int | None:
    versions = [v for r in results for v in r.versions]
    return max(versions) if versions else None


def _thinking(kwargs: Any) -> bool | None:
    """`chat_template_kwargs`, as vLLM's server takes it: here only {enable_thinking: bool}."""
    if kwargs is None:
        return None
    if (
        not isinstance(kwargs, dict)
        or set(kwargs) - {"enable_thinking"}
        or not isinstance(kwargs.get("enable_thinking", False), bool)
    ):
        raise ApiError(
            "chat_template_kwargs: only {enable_thinking: true|false} is supported",
            param="chat_template_kwargs",
        )
    return kwargs.get("enable_thinking")


def _messages(
    messages: Any, render: Callable[[list[dict], bool | None], list[int]] | None, thinking: bool | None
) -> list[int]:
    if render is None:
        raise ApiError("this model has no chat template: use /v1/completions with a prompt", status=400)
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise ApiError(
            "messages: must be a non-empty list of {role: str, content: str} objects", param="messages"
        )
    return render([{"role": m["role"], "content": m["content"]} for m in messages], thinking)


def _prompt(prompt: Any, encode: Callable[[str], list[int]], vocab: int) -> list[int]:
    if isinstance(prompt, str) and prompt:
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
        return list(prompt)
    raise ApiError(
        f"prompt: must be a non-empty string or a list of token ids in [0, {vocab}) (one prompt a request)",
        param="prompt",
    )


def _int(body: dict, key: str, default: int, low: int, high: int | None) -> int:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ApiError(f"{key}={v!r}: must be an integer {bound}", param=key)
    return v


def _float(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
        raise ApiError(f"{key}={v!r}: must be a number", param=key)
    return float(v)
