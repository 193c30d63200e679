"""`HistoryDrafter`: drafts from earlier responses to the same prompt (RhymeRL, DAS).

Per prompt (its token ids are the key) a `SuffixIndex` over its most recent responses: those the
caller hands in with `Engine.add_history` (earlier epochs, responses pre-generated in idle time) and
those the engine itself finishes (siblings in this round). A request tracks the longest suffix of its
response that occurs in its prompt's index and drafts what followed it there, at most as many tokens as
the match is long (a short match predicts little), within a budget by length class (DAS): a prompt
whose responses run short gets no drafts, a medium one half the draft length, a long one all of it --
short requests finish early anyway, long ones set the rollout's end.

Memory: `window` responses per prompt (older ones leave when the index is rebuilt at 2 x window) and
`max_prompts` prompts (least recently used leave first). A response is indexed when a request of its
prompt next asks for drafts, not when it arrives: the siblings that finish last, or while the toggle
keeps drafting off, are never walked into an index (at batch 64 that walk was ~11% of a rollout's
CPU time with nothing drafted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tailrace.engine.spec.drafter import DraftEnv, DraftRow
from tailrace.engine.spec.suffix import START, Match, SuffixIndex
from tailrace.model.decoder import CausalLM

MAX_MATCH = 32  # suffix tokens a request re-matches after its prompt's index changed
EMA = 0.5  # weight of a new response's length in its prompt's length average
MIN_PROMPTS = 8  # length classes need this many prompts with history; before, every prompt is long
SHORT, LONG = 1 / 3, 2 / 3  # quantiles of the prompts' average lengths bounding the medium class


def length_budget(ema: float, lengths: Sequence[float], k: int) -> int:
    """DAS's rule: the draft budget of a prompt whose responses average `ema` tokens, among prompts
    averaging `lengths` (sorted): none below the SHORT quantile, half at most up to LONG, all of k above."""
    n = len(lengths)
    if n < MIN_PROMPTS:
        return k
    if ema < lengths[int(SHORT * n)]:
        return 0
    if ema < lengths[int(LONG * n)]:
        return max(1, k // 2)
    return k


class _Prompt:
    __slots__ = ("responses", "index", "stamp", "ema", "pending")

    def __init__(self) -> None:
        self.responses: list[Sequence[int]] = []
        self.index = SuffixIndex()
        self.stamp = 0  # changes whenever the index does
        self.ema = 0.0
        self.pending = 0  # the last responses not yet in the index; -1: the index is to be rebuilt

    def indexed(self) -> SuffixIndex:
        """The index, with every response in it."""
        if self.pending:
            if self.pending < 0:
                self.index = SuffixIndex()
            for r in self.responses[-self.pending :] if self.pending > 0 else self.responses:
                self.index.add(r)
            self.pending = 0
            self.stamp += 1
        return self.index


@dataclass(slots=True)
class _Reader:
    prompt: _Prompt
    stamp: int
    seen: int  # response tokens walked
    match: Match


class HistoryDrafter:
    name = "history"
    per_token_cost = False

    def __init__(self, env: DraftEnv | None = None, window: int = 16, max_prompts: int = 4096):
        self.window, self.max_prompts = window, max_prompts
        self._prompts: OrderedDict[tuple[int, ...], _Prompt] = OrderedDict()
        self._readers: dict[str, _Reader] = {}
        self._lengths: list[float] | None = []  # sorted prompt averages; None: to recompute

    def add_history(self, prompt: tuple[int, ...], tokens: Sequence[int]) -> None:
        p = self._prompts.get(prompt)
        if p is None:
            p = self._prompts[prompt] = _Prompt()
            p.ema = len(tokens)
            if len(self._prompts) > self.max_prompts:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(prompt)
            p.ema += EMA * (len(tokens) - p.ema)
        self._lengths = None
        p.responses.append(tuple(tokens))
        if len(p.responses) > 2 * self.window:
            p.responses = p.responses[-self.window :]
            p.pending = -1
        elif p.pending >= 0:
            p.pending += 1

    def budget(self, prompt: tuple[int, ...], k: int) -> int:
        """The most of `k` draft tokens a request of `prompt` can get, whatever its response: none
        without history, else its length class's budget. The engine asks no row it cannot help, so
        it copies no such row's tokens off the device."""
        p = self._prompts.get(prompt)
        if p is None:
            return 0
        if self._lengths is None:
            self._lengths = sorted(q.ema for q in self._prompts.values())
        return length_budget(p.ema, self._lengths, k)

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        out = []
        for r in rows:
            k = self.budget(r.prompt, r.k)
            if not k:
                out.append([])
                continue
            p = self._prompts[r.prompt]
            index = p.indexed()
            m = self._match(r, p)
            out.append(index.continuation(m, min(k, m.length)))
        return out

    def _match(self, r: DraftRow, p: _Prompt) -> Match:
        """The request's match, walked over its new tokens (or re-matched from its last MAX_MATCH
        tokens when its prompt's index changed since)."""
        rd = self._readers.get(r.request_id)
        toks = r.tokens
        if rd is None or rd.prompt is not p or rd.stamp != p.stamp or rd.seen > len(toks):
            tail = toks[-MAX_MATCH:]
            m = p.index.walk_all(Match(), tail if len(toks) > MAX_MATCH else (START, *tail))
            self._readers[r.request_id] = _Reader(p, p.stamp, len(toks), m)
            return m
        if rd.seen < len(toks):
            rd.match = p.index.walk_all(rd.match, toks[rd.seen :])
            rd.seen = len(toks)
        return rd.match

    def release(self, request_id: str) -> None:
        self._readers.pop(request_id, None)

    def load(self, version: int, model: CausalLM) -> None:
        pass  # drafts from tokens, not weights

    def drop(self, version: int) -> None:
        pass

    def train(self, budget_s: float) -> None:
        return None  # nothing to learn: it looks up
