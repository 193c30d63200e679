"""The pure cores of speculative decoding, on hand-checked cases: verification, the draft-length
ladder, the toggle's cost model, the suffix index and DAS's length budget."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.engine.spec import accept, costs, ladder
from tailrace.engine.spec.costs import ByBatch, LowFit, Toggle, expected_length, speedup
from tailrace.engine.spec.history import MIN_PROMPTS, length_budget
from tailrace.engine.spec.ladder import Rung, climb
from tailrace.engine.spec.quant import GROUP4, quantize_rtn, quantized_copy
from tailrace.engine.spec.speculator import SpecOptions, Speculator
from tailrace.engine.spec.suffix import END, START, Match, SuffixIndex


def test_verify_keeps_the_agreeing_prefix_and_the_targets_next_token():
    # all agree: the bonus token too
    assert accept.verify([5, 6, 7], [5, 6, 7, 8], ()) == (3, 4, False)
    # first disagreement at 2: the target's 9 replaces the draft's 7, the rest is dropped
    assert accept.verify([5, 6, 7, 1], [5, 6, 9, 1, 2], ()) == (2, 3, False)
    # none agree: plain decoding's one token
    assert accept.verify([4], [5, 6], ()) == (0, 1, False)
    # a stop token among the emitted ends the row just after it, accepted or the correction
    assert accept.verify([5, 0, 7], [5, 0, 7, 8], (0,)) == (3, 2, True)
    assert accept.verify([5, 6, 7], [5, 0, 7, 8], (0,)) == (1, 2, True)
    assert accept.verify([5, 6], [0, 6, 3], (0,)) == (0, 1, True)
    # a stop past the first disagreement is never emitted
    assert accept.verify([5, 6], [5, 7, 0], (0,)) == (1, 2, False)


def test_ladder_moves_one_rung_after_holding_two_rounds():
    r = Rung()
    assert r.gamma == 5
    r = climb(r, 0.99)  # first round on 5: held, whatever the acceptance
    assert (r.gamma, r.held) == (5, 1)
    r = climb(r, 0.95)  # second round at >= 0.94: up
    assert (r.gamma, r.held) == (7, 0)
    r = climb(climb(r, 0.90), 0.90)  # between the thresholds: stays
    assert (r.gamma, r.held) == (7, 2)
    r = climb(r, 0.85)  # held long enough, <= 0.85: down at once
    assert (r.gamma, r.held) == (5, 0)
    r = climb(climb(r, 0.5), 0.5)  # the bottom rung holds
    assert r.gamma == 5
    top = Rung(len(ladder.RUNGS) - 1, 5)
    assert climb(top, 1.0).gamma == 11 and climb(top, 0.8).gamma == 9


def test_ladder_bounds():
    assert (
        ladder.rungs(5, 11) == ladder.RUNGS
        and ladder.rungs(3, 3) == (3,)
        and ladder.rungs(2, 7) == (2, 4, 6, 7)
    )
    r = Rung(rungs=(3,))
    assert climb(climb(climb(r, 1.0), 1.0), 0.0).gamma == 3


def test_speculator_without_toggle_always_drafts_the_ladders_length():
    class Lookup:
        per_token_cost = False

    on, off = Speculator(Lookup()), Speculator(Lookup(), SpecOptions(toggle=False, gamma_min=2, gamma_max=4))
    assert on.cap(1) == 0  # no timings: the toggle cannot predict a gain
    assert off.cap(1) == 2 and off.gamma(0.0, 50.0, 64, off.cap(64), step=1) == 2
    with pytest.raises(ValueError, match="gamma_min"):
        SpecOptions(gamma_min=4, gamma_max=3)


def test_expected_length_and_speedup_by_hand():
    assert expected_length(0.0, 5) == 1.0
    assert expected_length(1.0, 5) == 6.0
    assert expected_length(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_length(0.8, 4) == pytest.approx(sum(0.8**i for i in range(5)))
    # EfficientRollout's form: L / (gamma r + v)
    assert speedup(0.5, 2, 0.0, 1.0) == pytest.approx(1.75)
    assert speedup(0.8, 4, 0.1, 1.5) == pytest.approx(3.3616 / 1.9)
    assert speedup(1.0, 3, 1 / 3, 1.0) == pytest.approx(2.0)  # 4 tokens for the time of 2 steps


def test_low_fit_converges_to_the_low_side_of_noisy_samples():
    f = LowFit([0.0, 0.0])
    rng = random.Random(0)
    for _ in range(600):
        d, v = rng.randint(1, 40), rng.randint(1, 8)
        burst = 3.0 if rng.random() < 0.2 else 1.0  # a fifth of the timings hit by a neighbour
        f.observe([d, v], burst * (0.05 * d + 0.3 * v))
    assert f([10, 2]) == pytest.approx(0.05 * 10 + 0.3 * 2, rel=0.15)
    assert f.weight == 600


def test_by_batch_tracks_the_uncontended_time_and_interpolates():
    t = ByBatch()
    assert t(4) is None and t.per_row() is None
    t.observe(1, 1.0)
    t.observe(8, 2.0)
    assert t(1) == 1.0 and t(4) == pytest.approx(1 + 3 / 7) and t(9) is None
    assert t.per_row() == pytest.approx(1 / 7)
    t.observe(8, 4.0)  # slower (a neighbour's burst): a small step up
    assert t(8) == pytest.approx(2.0 + costs.RISE * 2)
    t.observe(8, 1.0)  # faster: a large step down
    assert t(8) == pytest.approx(2.1 - costs.FALL * 1.1)
    assert [costs.bucket(n) for n in (1, 16, 17, 19, 20, 32, 64, 100)] == [1, 16, 16, 19, 19, 32, 64, 108]


def _toggle(x_ms=None, y_ms=0.0, draft_ms=None, per_token=False):
    """Decode steps of 1 + b / 8 ms at batches 1..64 (each its own bucket); if x_ms, verify steps costing
    x_ms per draft token and y_ms per verifying row more; drafter calls of draft_ms(rows)."""
    t = Toggle(per_token_draft=per_token)
    batches = [*range(1, 17), 19, 23, 27, 32, 38, 45, 54, 64]  # one bucket each
    for b in batches:
        t.observe_step(b, 0, 0, (1 + b / 8) / 1e3)
    for _ in range(20 if draft_ms else 0):
        for b in batches:
            t.observe_draft(b, 1, draft_ms(b) / 1e3)
    for _ in range(20 if x_ms is not None else 0):  # the fit moves a step per timing: let it settle
        for b in batches:
            for g in (1, 3, 5):
                ms = 1 + b / 8 + x_ms * b * g + y_ms * b  # every draft accepted: no veto
                t.observe_step(b, b * g, b, ms / 1e3, 0.0, emitted=b * (g + 1))
    return t


def test_toggle_by_hand():
    # no verify timed: a draft token costs what a decode row does (1/8 ms); drafting is free
    t = _toggle()
    # batch 1, alpha 0.8, gamma 3: L = 2.952, v = 1 + 3 (1/8) / 1.125
    assert t.predict(1, 0.8, 3) == pytest.approx(2.952 / (1 + 0.375 / 1.125), rel=1e-3)
    # batch 64: T = 9, a verify of g drafts 9 + 8 g: never pays at alpha 0.5
    assert t.gamma(64, 0.5, 5) == 0
    # batch 1 pays from alpha 0.25 up; the best length grows with alpha
    g = [t.gamma(1, a, 11) for a in (0.0, 0.25, 0.5, 0.8, 0.95, 1.0)]
    assert g[0] == 0 and all(x > 0 for x in g[1:]) and g == sorted(g) and g[-1] == 11
    assert t.gamma(1, 1.0, 5) == 5  # the ladder caps it
    # verifies timed: 0.05 ms per draft token, 0.3 ms per verifying row
    timed = _toggle(x_ms=0.05, y_ms=0.3)
    assert timed.predict(2, 0.8, 3) == pytest.approx(2.952 / (1 + (0.05 * 6 + 0.3 * 2) / 1.25), rel=1e-2)
    assert timed.predict(8, 0.8, 3) == pytest.approx(2.952 / (1 + (0.05 * 24 + 0.3 * 8) / 2), rel=1e-2)
    # a model drafter as dear per draft step as a decode step never pays at alpha 0.5; a cheap one does
    dear = _toggle(draft_ms=lambda rows: 1 + rows / 8, per_token=True)
    assert dear.gamma(1, 0.5, 11) == 0
    assert dear.predict(1, 1.0, 1) == pytest.approx(2 / (1 + 1 + 0.125 / 1.125), rel=1e-2)
    cheap = _toggle(draft_ms=lambda rows: 0.1 + rows / 80, per_token=True)
    assert cheap.predict(1, 1.0, 1) == pytest.approx(2 / (0.1125 / 1.125 + 1 + 0.125 / 1.125), rel=1e-2)
    assert cheap.gamma(1, 0.5, 11) > 0


def test_toggle_vetoes_a_batch_where_verify_steps_measure_slower_then_tries_it_again():
    t = _toggle()  # the model says batch 8 pays at alpha 0.8
    assert t.gamma(8, 0.8, 5) > 0
    for _ in range(costs.JUDGED):  # verify steps: 1.2 tokens per row for twice a plain step's time
        t.observe_step(8, 16, 8, 2 * (1 + 8 / 8) / 1e3, 0.0, emitted=int(1.2 * 8))
    assert t.gamma(8, 0.8, 5) == 0 and t.gamma(8, 0.8, 5, veto=False) > 0 and t.gamma(4, 0.8, 5) > 0
    for _ in range(costs.RETRY - 1):  # plain steps at batch 8: still vetoed
        t.observe_step(8, 0, 0, (1 + 8 / 8) / 1e3)
    assert t.gamma(8, 0.8, 5) == 0
    t.observe_step(8, 0, 0, (1 + 8 / 8) / 1e3)
    assert t.gamma(8, 0.8, 5) > 0  # a fresh trial
    for _ in range(20):  # verify steps that double the tokens in the same time: it stays on
        t.observe_step(8, 40, 8, (1 + 8 / 8) / 1e3, 0.0, emitted=16)
    assert t.gamma(8, 0.8, 5) > 0


def test_toggle_waits_twice_as_long_each_time_a_retried_batch_is_vetoed_again():
    t = _toggle()
    slow = lambda: t.observe_step(8, 16, 8, 2 * (1 + 8 / 8) / 1e3, 0.0, emitted=int(1.2 * 8))  # noqa: E731
    plain = lambda: t.observe_step(8, 0, 0, (1 + 8 / 8) / 1e3)  # noqa: E731
    waits = []
    for _ in range(3):  # veto, wait it out (counting the plain steps), a failing trial: vetoed again
        for _ in range(costs.JUDGED):
            slow()
        n = 0
        while t.gamma(8, 0.8, 5) == 0:
            plain()
            n += 1
        waits.append(n)
    assert waits == [costs.RETRY, 2 * costs.RETRY, 4 * costs.RETRY]
    for _ in range(costs.JUDGED):  # a trial that pays: the next veto waits RETRY again
        t.observe_step(8, 40, 8, (1 + 8 / 8) / 1e3, 0.0, emitted=16)
    assert t.gamma(8, 0.8, 5) > 0
    while t.gamma(8, 0.8, 5) > 0:  # slow verify steps again, until their average says so
        slow()
    n = 0
    while t.gamma(8, 0.8, 5) == 0:
        plain()
        n += 1
    assert n == costs.RETRY
    assert costs.RETRY * 2**10 > costs.RETRY_MAX  # the wait is capped


def test_toggle_threshold_is_min_speedup():
    # verifying costs nothing more: at alpha 0 a verify emits the one token a decode step would
    t = _toggle(x_ms=0.0)
    assert t.predict(1, 0.0, 1) == pytest.approx(1.0, abs=1e-3) and t.gamma(1, 0.0, 1) == 0
    assert t.predict(1, 0.1, 1) == pytest.approx(1.1, abs=1e-3) and t.gamma(1, 0.1, 1) == 1
    # the table rounds alpha down to a twentieth: 0.09 is judged as 0.05 (1.05 - a rounding)
    assert t.gamma(1, 0.09, 1) == (t.predict(1, 0.05, 1) >= 1.05)


@pytest.mark.parametrize("bits", [8, 4])
def test_rtn_quantization_rounds_to_the_nearest_level_of_its_channel_or_group(bits):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    q = quantize_rtn(w, bits)
    qmax = 2 ** (bits - 1) - 1
    group = 64 if bits == 8 else GROUP4
    scale = w.reshape(6, -1, group).abs().amax(-1, keepdim=True) / qmax  # per channel or group
    levels = q.reshape(6, -1, group) / scale
    assert torch.allclose(levels, levels.round(), atol=1e-4) and levels.abs().max() <= qmax + 1e-4
    assert ((q - w).reshape(6, -1, group).abs() <= scale / 2 + 1e-6).all()


def test_quantized_copy_shares_embeddings_and_head_and_quantizes_the_layers():
    from tests.engine.engine_helpers import tiny_model

    m = tiny_model(0)
    c = quantized_copy(m, 8)
    assert c.model.embed_tokens.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert c.lm_head.weight.data_ptr() == m.lm_head.weight.data_ptr()
    a, b = m.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=a.abs().max().item() / 127)


def _occurs(seqs, needle):
    for s in seqs:
        text = [START, *s, END]
        for i in range(len(text) - len(needle) + 1):
            if text[i : i + len(needle)] == needle:
                return True
    return False


@settings(max_examples=200, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=4),
    ctx=st.lists(st.integers(0, 3), max_size=16),
)
def test_suffix_index_tracks_the_longest_occurring_suffix_and_drafts_a_true_continuation(seqs, ctx):
    idx = SuffixIndex()
    for s in seqs:
        idx.add(s)
    text = [START, *ctx]
    m = Match()
    for i in range(len(text)):
        m = idx.walk(m, text[i])
        seen = text[: i + 1]
        longest = max((n for n in range(len(seen) + 1) if _occurs(seqs, seen[len(seen) - n :])), default=0)
        assert m.length == longest
        cont = idx.continuation(m, 4)
        assert all(t >= 0 for t in cont)
        if m.length:
            assert _occurs(seqs, seen[len(seen) - m.length :] + cont)
        else:
            assert cont == []


def test_suffix_index_by_hand():
    idx = SuffixIndex()
    idx.add([1, 2, 3, 4])
    idx.add([1, 2, 5])
    m = idx.walk_all(Match(), [START])
    assert idx.continuation(m, 3) == [1, 2, 3]  # a sequence's start: the first stored one's
    m = idx.walk_all(m, [1, 2])
    assert m.length == 3 and idx.continuation(m, 9) == [3, 4]  # cut at its end
    m = idx.walk(m, 5)
    assert m.length == 4 and idx.continuation(m, 2) == []
    m = idx.walk_all(Match(), [9, 9, 2])  # only the last token occurs
    assert m.length == 1 and idx.continuation(m, 1) == [3]


def test_length_budget_by_class():
    lengths = sorted([10, 20, 30, 40, 50, 60, 70, 80, 90])
    assert len(lengths) >= MIN_PROMPTS
    assert length_budget(15, lengths, 8) == 0  # below the lower third
    assert length_budget(50, lengths, 8) == 4  # medium: half
    assert length_budget(75, lengths, 8) == 8  # long: all
    assert length_budget(5, lengths[: MIN_PROMPTS - 1], 8) == 8  # too few prompts for classes
    assert math.isclose(length_budget(40, lengths, 1), 1)  # medium keeps at least one


def test_history_indexes_responses_when_their_prompt_next_drafts():
    """Responses wait outside the index until a request of their prompt asks for drafts (the last
    siblings of a round are never walked); past 2 x window the index is rebuilt from the last window."""
    from tailrace.engine.spec.drafter import DraftRow
    from tailrace.engine.spec.history import HistoryDrafter

    d = HistoryDrafter(window=2)
    prompt = (1, 2)
    for r in ([5, 6, 7, 9], [5, 6, 8, 9]):
        d.add_history(prompt, r)
    p = d._prompts[prompt]
    assert p.index.sequences == 0 and p.pending == 2

    def ask(tokens, rid="r"):
        return d.propose([DraftRow(rid, prompt, tokens, 3, 0, len(tokens), 0)])[0]

    assert ask([5, 6, 8]) == [9]  # the later response's continuation of the match 5 6 8
    assert p.index.sequences == 2 and p.pending == 0
    d.add_history(prompt, [4, 4, 4, 4])
    assert ask([5, 6, 8, 9, 4, 4], rid="s") == [4, 4]  # one more indexed on the next ask
    assert p.index.sequences == 3
    for r in ([3, 3], [2, 2]):  # 5 responses > 2 x window: the last 2 alone, rebuilt when asked
        d.add_history(prompt, r)
    assert p.pending == -1
    assert ask([7], rid="t") == [] and p.index.sequences == 2 and len(p.responses) == 2
