"""Verification of a draft, exact by construction (pure Python, no torch).

The engine samples every token as argmax(processed logits + Gumbel noise), the noise a function of
(request seed, response index) alone (see `engine.sampler`). So the token the target would emit at a
position depends only on its logits there, and those depend only on the tokens before it. A verify
forward runs the target over the row's last token and the draft d_1..d_g at once and samples the
target's own token t_0..t_g at every position with the noise plain decoding would use there. While
d_i == t_{i-1} the target has seen exactly the prefix plain decoding would have produced, so
t_0..t_a (a = accepted drafts) are the tokens plain decoding emits, one per step, with the same
logprobs: nothing else is kept. No probabilities of the drafter enter, so any drafter -- a lookup, a
model, garbage -- changes the time a request takes, never its tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def accepted(draft: Sequence[int], target: Sequence[int]) -> int:
    """How many draft tokens the target confirms: the longest a with draft[:a] == target[:a], where
    target[i] is the target's token at the position of draft[i] (len(target) >= len(draft))."""
    a = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        a += 1
    return a


def verify(draft: Sequence[int], target: Sequence[int], stop_ids: Collection[int]) -> tuple[int, int, bool]:
    """A verified row: (accepted drafts a, tokens of `target` it emits, whether it stopped). It emits
    t_0..t_a -- the accepted ones and the target's token after them (its correction at the first
    disagreement, or the bonus token when all agree) -- cut just after the first stop token.
    target: len(draft) + 1 tokens."""
    a = accepted(draft, target)
    for i in range(a + 1):
        if target[i] in stop_ids:
            return a, i + 1, True
    return a, a + 1, False
