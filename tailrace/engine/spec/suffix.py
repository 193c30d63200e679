"""`SuffixIndex`: a suffix automaton over token sequences, for drafting continuations from history
(pure Python).

The automaton recognizes every substring of the stored sequences; each state stands for a class of
substrings that end at the same set of places, and remembers where its first occurrence ends, so the
tokens that followed it are a candidate continuation. A reader tracks the longest suffix of its own
sequence that occurs in the store as a `Match` (state, length), advanced one token at a time in
amortized O(1) (Blumer et al. 1985; the construction is the classic online one). Sequences are stored
as START t_1 ... t_n END: START lets a reader at the very beginning of its sequence match the
beginnings of stored ones, and END (like START, a negative id no real token has) stops a continuation
at the end of the sequence it came from, so matches never span two sequences.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

START, END = -1, -2


@dataclass(frozen=True)
class Match:
    state: int = 0  # 0: the root (nothing matched)
    length: int = 0  # tokens of the reader's sequence matched (START counts as one)


class SuffixIndex:
    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]  # transitions per state
        self.link: list[int] = [-1]  # suffix link
        self.len: list[int] = [0]  # length of the longest substring in the state
        self.end: list[int] = [-1]  # index in `text` where the state's first occurrence ends
        self.text: list[int] = []
        self._last = 0
        self.sequences = 0

    def add(self, tokens: Iterable[int]) -> None:
        """Store one sequence."""
        for t in (START, *tokens, END):
            self._extend(t)
        self.sequences += 1

    def _extend(self, c: int) -> None:
        nxt, link, ln, end = self.next, self.link, self.len, self.end
        self.text.append(c)
        cur = len(nxt)
        nxt.append({})
        link.append(0)
        ln.append(ln[self._last] + 1)
        end.append(len(self.text) - 1)
        p = self._last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if ln[p] + 1 == ln[q]:
                link[cur] = q
            else:  # split q: a clone holds the shorter substrings that now also end here
                clone = len(nxt)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                ln.append(ln[p] + 1)
                end.append(end[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self._last = cur

    def walk(self, m: Match, token: int) -> Match:
        """The match after the reader's sequence grew by `token`: the longest suffix of it that occurs."""
        s, n = m.state, m.length
        nxt, link, ln = self.next, self.link, self.len
        while s and token not in nxt[s]:
            s = link[s]
            n = ln[s]
        if token in nxt[s]:
            return Match(nxt[s][token], n + 1)
        return Match()

    def walk_all(self, m: Match, tokens: Iterable[int]) -> Match:
        for t in tokens:
            m = self.walk(m, t)
        return m

    def continuation(self, m: Match, k: int) -> list[int]:
        """Up to k tokens that followed the first occurrence of the match (none at the root), cut at
        the end of the sequence it occurred in."""
        if not m.state or k <= 0:
            return []
        e = self.end[m.state] + 1
        out = self.text[e : e + k]
        for i, t in enumerate(out):
            if t < 0:
                return out[:i]
        return out
