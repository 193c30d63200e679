"""`Sequence`: the host-side state of one request inside the engine (no torch).

Generated tokens and their logprobs live in device buffers indexed by cache row (see `RowState`);
the host keeps only counters, from which it knows every length without reading the device:
a decoding sequence gains one token per decode step, so its count is
`new_at_join + (engine decode steps since it joined)`; a verified draft's extra tokens are added to
`new_at_join` (and `pos_key`), which keeps that formula true. `finish_step` and `grow_step` say when
it reaches its length and next needs a block; the engine's schedules hold entries for older values
too, which it skips.
"""

from __future__ import annotations

from tailrace.types import GenRequest


class Sequence:
    __slots__ = (
        "req",
        "ids",
        "key",
        "submitted",
        "first_token",
        "prefilled",
        "new_at_join",
        "joined_at",
        "allowed",
        "pos_key",
        "age",
        "finish_step",
        "grow_step",
        "host",
        "accepted",
        "compared",
    )

    def __init__(self, req: GenRequest, key: int, submitted: float, max_context: int, age: int):
        self.req = req
        self.ids = req.prompt_ids + req.resume_ids  # what prefill feeds
        self.key = key  # 32-bit noise key from the request's seed
        self.submitted = submitted
        self.first_token = 0.0
        self.prefilled = 0  # tokens of `ids` whose k/v are in the cache
        self.new_at_join = 0  # new tokens when it joined the decode batch (the one sampled by prefill)
        self.joined_at = -1  # engine decode-step counter at join; -1 = not decoding
        # New tokens it may still produce: the rest of max_new_tokens (which counts the resumed
        # prefix) and the rest of the context.
        self.allowed = min(req.params.max_new_tokens - len(req.resume_ids), max_context - len(self.ids))
        self.pos_key = 0  # position of its decode input minus the decode-step counter (for max position)
        self.age = age  # arrival number in the engine (smaller = older), kept across preemptions
        self.finish_step = -1  # decode step at which it has all its allowed tokens
        self.grow_step = -1  # decode step at which its next block is due
        # speculative decoding: a host copy of its response (as far as read back) and its drafts'
        # per-token acceptance (see `spec.ladder`)
        self.host: list[int] = list(req.resume_ids)
        self.accepted = self.compared = 0.0

    @property
    def id(self) -> str:
        return self.req.id

    @property
    def version(self) -> int:
        return self.req.version

    @property
    def num_resumed(self) -> int:
        return len(self.req.resume_ids)

    @property
    def to_prefill(self) -> int:
        return len(self.ids) - self.prefilled

    def num_new(self, decode_step: int) -> int:
        """New tokens generated so far (excluding the resumed prefix)."""
        if self.joined_at < 0:
            return self.new_at_join
        return self.new_at_join + decode_step - self.joined_at
