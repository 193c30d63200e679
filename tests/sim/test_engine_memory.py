"""The simulated engine's KV memory: admission stops when the next step would not fit, and when
growing contexts fill the cache the most recently admitted sequence is preempted, requeued at the
front and prefilled again with what it had generated (vLLM's recompute preemption); loaded versions
beyond the first take their weights' worth of cache. Checked against a per-token reference."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.commands import Generate, LoadWeights
from tailrace.sim.engine import SimEngine
from tests.sim.test_engine import COST, Table, key, samples


def reference(table, slots, smps, cap, prompt=50):
    """Token by token: at each boundary preempt (latest admitted first) while the next step does not
    fit, then admit from the front while the next step fits everyone; a readmitted sequence prefills
    its prompt and the tokens it had. Returns ({id: (time, tokens)}, preemptions)."""
    t, queue, running, out, pre, order = 0.0, [[s, 0] for s in smps], {}, {}, 0, 0
    while queue or running:
        usage = sum(prompt + r[0] for r in running.values())
        while running and usage + len(running) > cap:
            sid = max(running, key=lambda s: running[s][3])
            tok, _, s, _ = running.pop(sid)
            queue.insert(0, [s, tok])
            usage -= prompt + tok
            pre += 1
        new = []
        while queue and len(running) + len(new) < slots:
            s, tok = queue[0]
            if usage + len(running) + len(new) + prompt + tok + 1 > cap:
                break
            new.append(queue.pop(0))
            usage += prompt + tok
        if new:
            t += COST.prefill_time([prompt + tok for _, tok in new])
            for s, tok in new:
                order += 1
                running[s.id] = [tok, table[key(s)], s, order]
        assert running, "nothing fits"
        ctx = sum(prompt + r[0] for r in running.values())
        t += COST.decode_segment({0: (len(running), ctx)}).step_time(0)
        for sid in list(running):
            running[sid][0] += 1
            if running[sid][0] == running[sid][1]:
                out[sid] = (t, running.pop(sid)[0])
    return out, pre


def analytic(table, slots, smps, cap):
    eng = SimEngine(0, slots, COST, Table(table), kv_tokens=cap)
    eng.post(Generate(0, tuple(smps)))
    now, out = 0.0, {}
    while (nxt := eng.plan(now)) is not None:
        now = nxt
        for r in eng.fire().results:
            out[r.request_id] = (now, len(r.token_ids))
    return out, eng


def check(ref, got):
    assert set(ref) == set(got)
    for sid in ref:
        assert got[sid][1] == ref[sid][1], sid
        assert got[sid][0] == pytest.approx(ref[sid][0], rel=1e-9), sid


def test_admission_waits_for_room_in_the_cache():
    """Room for two 50-token prompts and their 25 tokens each (2 x 75 + 2 <= 152), not for a third
    prompt beside them (3 x 50 + 3 > 152): it waits for the first two to finish."""
    table = {(0, i): 25 for i in range(3)}
    ref, pre = reference(table, 8, samples(table), cap=152)
    got, eng = analytic(table, 8, samples(table), cap=152)
    check(ref, got)
    assert pre == 0 and eng.preemptions == 0
    assert got["0.2.0"][0] > got["0.0.0"][0]  # the third started after the first two finished


def test_growing_contexts_preempt_the_latest_admitted_which_recomputes_its_tokens():
    """Two sequences of 300 tokens fit at admission (2 x 51 <= 450) but not grown: the second is
    preempted when the cache fills, requeued, and prefilled again with its tokens once the first is done."""
    table = {(0, 0): 300, (0, 1): 300}
    ref, pre = reference(table, 8, samples(table), cap=450)
    got, eng = analytic(table, 8, samples(table), cap=450)
    check(ref, got)
    assert pre == 1 and eng.preemptions == 1 and eng.recomputed_tokens > 0
    assert got["0.1.0"][1] == 300


def test_a_second_loaded_version_takes_its_weights_worth_of_cache():
    eng = SimEngine(0, 8, COST, Table({}), kv_tokens=10**7)
    assert eng.kv_free() == 10**7
    eng.post(LoadWeights(0, 1))
    eng.plan(0.0)
    eng.fire()
    assert eng.kv_free() == 10**7 - COST.version_kv_tokens()


def test_a_request_that_can_never_fit_is_an_error():
    table = {(0, 0): 10}
    with pytest.raises(RuntimeError, match="KV cache"):
        analytic(table, 8, samples(table), cap=40)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000), n=st.integers(1, 20), slots=st.integers(1, 12), cap=st.integers(400, 3000)
)
def test_random_lengths_under_memory_pressure_match_the_reference(seed, n, slots, cap):
    rng = random.Random(seed)
    table = {
        (g, i): max(1, min(cap - 60, int(rng.lognormvariate(4.0, 1.0)))) for g in range(n) for i in range(2)
    }
    smps = samples(table)
    check(reference(table, slots, smps, cap)[0], analytic(table, slots, smps, cap)[0])
