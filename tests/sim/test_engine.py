"""The simulated engine's analytic advance (one event per request boundary) against a per-token
reference that recomputes the step time from scratch at every token."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.commands import Abort, Generate, LoadWeights
from tailrace.flow.keys import SampleKey
from tailrace.sim.costs import CostModel
from tailrace.sim.engine import SimEngine
from tailrace.sim.hardware import GPUS
from tailrace.sim.lengths import LengthModel
from tailrace.types import Finish, GenRequest, SamplingParams

COST = CostModel(GPUS["h100"], __import__("tailrace.sim.models", fromlist=["MODELS"]).MODELS["qwen2.5-7b"])


class Table(LengthModel):
    def __init__(self, table, max_len=10_000, prompt=50):
        self.table, self.max_len, self.prompt = table, max_len, prompt

    def response(self, pid, idx):
        return self.table[(pid, idx)]

    def prompt_len(self, pid):
        return self.prompt


def samples(lengths: dict, versions=lambda i: 0):
    """One request per (prompt, index) of `lengths`; its id is the sample key (group = prompt id)."""
    out = []
    for i, (pid, idx) in enumerate(sorted(lengths)):
        rid = str(SampleKey(pid, idx))
        out.append(GenRequest(rid, (1,) * 50, SamplingParams(), version=versions(i)))
    return out


def key(s: GenRequest) -> tuple[int, int]:
    k = SampleKey.parse(s.id)
    return k.group, k.index


def reference(table, slots, smps, aborts=()):
    """Step by step: admit at boundaries (prefill), one decode step for all running, aborts at the
    first boundary at or after their time. Returns {sample id: (time, tokens, finish)}."""
    t, queue, running, out = 0.0, list(smps), {}, {}
    aborts = sorted(aborts)

    def apply_aborts():
        while aborts and aborts[0][0] <= t:
            _, sid = aborts.pop(0)
            for s in [s for s in queue if s.id == sid]:
                queue.remove(s)
                out[sid] = (t, 0, Finish.ABORTED)
            if sid in running:
                out[sid] = (t, running.pop(sid)[0], Finish.ABORTED)

    while queue or running:
        while True:  # a boundary: apply what is due, admit into free slots (a prefill moves the clock)
            apply_aborts()
            new = []
            while queue and len(running) + len(new) < slots:
                new.append(queue.pop(0))
            if not new:
                break
            t += COST.prefill_time([50] * len(new))
            for s in new:
                running[s.id] = [0, table[key(s)], s.version]
        if not running:
            continue
        batch = {}
        for tok, _, v in running.values():
            b, c = batch.get(v, (0, 0))
            batch[v] = (b + 1, c + 50 + tok)
        t += COST.decode_segment(batch).step_time(0)
        for sid in list(running):
            running[sid][0] += 1
            if running[sid][0] == running[sid][1]:
                out[sid] = (t, running.pop(sid)[0], Finish.STOP)
    return out


def analytic(table, slots, smps, aborts=(), loaded=(0,)):
    eng = SimEngine(0, slots, COST, Table(table))
    eng.loaded = set(loaded)
    eng.post(Generate(0, tuple(smps)))
    posts = sorted(aborts)
    now, out, events = 0.0, {}, 0
    while True:
        nxt = eng.plan(now)
        if posts and (nxt is None or posts[0][0] <= nxt):
            now, sid = posts.pop(0)
            eng.post(Abort(0, (sid,), "test"))
            continue
        if nxt is None:
            return out, events, eng
        now = nxt
        events += 1
        version = {s.id: s.version for s in smps}
        for r in eng.fire().results:
            out[r.request_id] = (now, len(r.token_ids), r.finish)
            assert set(r.versions) <= {version[r.request_id]}


def check(ref, got):
    assert set(ref) == set(got)
    for sid in ref:
        assert got[sid][1:] == ref[sid][1:], sid
        assert got[sid][0] == pytest.approx(ref[sid][0], rel=1e-9), sid


def test_constant_batch_one_event_per_completion():
    table = {(g, i): 100 + 37 * g + 11 * i for g in range(4) for i in range(3)}
    ref = reference(table, 64, samples(table))
    got, events, _ = analytic(table, 64, samples(table))
    check(ref, got)
    assert events <= 1 + len(table)  # the admission, then one event per distinct completion step


def test_slots_refill_at_completions():
    table = {(g, i): 40 + (g * 53 + i * 17) % 200 for g in range(6) for i in range(4)}
    check(reference(table, 5, samples(table)), analytic(table, 5, samples(table))[0])


def test_two_versions_in_one_batch():
    table = {(g, i): 30 + (g * 29 + i * 13) % 150 for g in range(4) for i in range(4)}
    smps = samples(table, versions=lambda i: i % 2)
    check(reference(table, 8, smps), analytic(table, 8, smps, loaded=(0, 1))[0])


def test_abort_mid_step_takes_effect_at_the_next_boundary_with_partial_tokens():
    table = {(0, i): 500 for i in range(4)}
    smps = samples(table)
    aborts = [(0.5, "0.1.0"), (0.5, "0.2.0"), (1.2345, "0.3.0")]
    ref = reference(table, 8, smps, aborts)
    got, _, _ = analytic(table, 8, smps, aborts)
    check(ref, got)
    assert got["0.1.0"][2] == Finish.ABORTED and 0 < got["0.1.0"][1] < 500


def test_aborted_requests_come_back_in_the_order_the_abort_names_them():
    """The order decides where the policy resumes each partial and in which order the engine admits it
    again, so it must not depend on string hashing (a set's order changes with PYTHONHASHSEED, and
    so did the simulated partial rollout's step time)."""
    table = {(0, i): 500 for i in range(24)}
    smps = samples(table)
    eng = SimEngine(0, 16, COST, Table(table))
    eng.post(Generate(0, tuple(smps)))  # 16 running, 8 queued
    assert eng.plan(0.0) == 0.0
    eng.fire()
    named = tuple(s.id for s in reversed(smps))
    eng.post(Abort(0, named, "test"))
    eng.plan(eng.t_b)
    assert [r.request_id for r in eng.fire().results] == list(named)


def test_resumed_partial_keeps_old_versions_and_finishes_at_its_length():
    table = {(0, 0): 300}
    eng = SimEngine(0, 4, COST, Table(table))
    eng.loaded = {0, 1}
    s = GenRequest(
        "0.0.1",
        (1,) * 50,
        SamplingParams(),
        version=1,
        resume_ids=(1,) * 120,
        resume_logprobs=(-1.0,) * 120,
        resume_versions=(0,) * 120,
    )
    eng.post(Generate(0, (s,)))
    now, res = 0.0, []
    while (nxt := eng.plan(now)) is not None:
        now = nxt
        res += eng.fire().results
    (r,) = res
    assert len(r.token_ids) == 300 and r.versions == (0,) * 120 + (1,) * 180


def test_weight_load_blocks_the_engine_and_reports_when_usable():
    eng = SimEngine(0, 4, COST, Table({}))
    eng.post(LoadWeights(0, 3))
    t = eng.plan(0.0)
    rep = eng.fire()
    assert t == 0.0 and rep.loaded == [(3, pytest.approx(COST.load_time()))] and 3 in eng.loaded


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 30), slots=st.integers(1, 12))
def test_random_lengths_match_the_per_token_reference(seed, n, slots):
    rng = random.Random(seed)
    table = {(g, i): max(1, int(rng.lognormvariate(3.5, 1.0))) for g in range(n) for i in range(2)}
    smps = samples(table, versions=lambda i: rng.randint(0, 1))
    t_end = max(v[0] for v in reference(table, slots, smps).values())
    aborts = [(rng.uniform(0, t_end), s.id) for s in rng.sample(smps, min(3, len(smps)))]
    check(reference(table, slots, smps, aborts), analytic(table, slots, smps, aborts, loaded=(0, 1))[0])


def test_host_gap_shows_as_bubble_not_as_slot_time():
    """A full batch of equal lengths: each step costs its roofline plus the gap; slot-time counts the
    steps only, so (slot-time / slots) / wall = step / (step + gap)."""
    import dataclasses

    gap = 2e-3
    cost = CostModel(dataclasses.replace(GPUS["h100"], host_gap_s=gap), COST.model)
    table = {(0, i): 200 for i in range(8)}
    eng = SimEngine(0, 8, cost, Table(table))
    eng.post(Generate(0, tuple(samples(table))))
    t = eng.plan(0.0)
    eng.fire()
    prefill = eng.t_b
    while (t := eng.plan(t)) is not None:
        eng.fire()
    step = cost.decode_segment({0: (8, 8 * 50)}).busy(200) / 200
    assert eng.t_b - prefill == pytest.approx(200 * (step + gap), rel=1e-6)
    assert eng.slot_time_at(eng.t_b) / 8 == pytest.approx(prefill + 200 * step, rel=1e-6)
