"""Speculative decoding in the engine is lossless: with any drafter -- one that knows the answer, one
that is often wrong, one that proposes garbage -- a seeded request gets the tokens, logprobs and
versions it gets without speculation, alone or in mixed batches, across versions, abort/resume and
preemption; and a verify leaves the KV cache as decoding only the accepted tokens would.

Tolerances: bf16 is bit-identical (its GEMMs give every row the same result whatever the batch); fp32
logprobs agree within 1e-6 here (MKL's fp32 GEMM takes different code paths for 1, 2-3 and 4+ rows, so
a row's last bits can depend on the batch shape, exactly as without speculation); the torch backend's
prefill-piece attention is another op than its decode attention, so there the bound is float noise."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tailrace.engine import TailraceEngine, ckernel
from tailrace.engine.kv_budget import GIB
from tailrace.engine.kv_cache import KVCache
from tailrace.engine.spec import DRAFTERS
from tailrace.engine.spec.costs import Toggle
from tailrace.engine.spec.speculator import EXPLORE
from tailrace.types import Finish, GenRequest
from tests.engine.engine_helpers import MOE, QWEN2_MOE, VOCAB, read_kv, req, tiny_model

TOL = {"float32": 1e-5, "bfloat16": 0.0}


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture(autouse=True)
def always_draft(monkeypatch):
    """Every row drafts the ladder's length whatever the timings say: the toggle would make what is
    exercised depend on this machine's speed (it is tested alone in test_spec_cores.py)."""
    monkeypatch.setattr(Toggle, "gamma", lambda self, batch, alpha, gamma_max, veto=True: gamma_max)


def test_under_the_toggle_a_garbage_drafter_soon_only_probes(model, monkeypatch):
    """With the real toggle (and decode timings where drafting would pay at batch 2): garbage drafts
    cost a few verifies per request, then at most the probes every EXPLORE steps (none once the
    drafter's own record says drafting cannot pay); no token changes."""
    monkeypatch.undo()
    monkeypatch.setattr(Toggle, "observe_step", lambda self, *a: None)
    reqs = [req(f"g{i}", 5, 120) for i in range(2)]
    plain = TailraceEngine(model, num_slots=2).generate(reqs)
    eng = TailraceEngine(model, num_slots=2, spec=Garbage({}))
    for b in (1, 2, 4, 8, 16, 32, 64):
        eng._spec.toggle.decode.observe(b, 1 + b / 8)
    _same(plain, eng.generate(reqs), TOL["float32"])
    st = eng.spec_stats
    assert st.accepted <= 2 and 2 <= st.verifies <= 2 * (3 + 120 // EXPLORE)


class Scripted:
    """Drafts the true continuation (from a run without speculation), each token replaced by a random
    one with probability `noise` (1.0: garbage), and nothing for a `silent` share of the calls."""

    name, per_token_cost = "scripted", False

    def __init__(self, truth: dict[str, tuple[int, ...]], noise: float = 0.0, silent: float = 0.0, seed=0):
        self.truth, self.noise, self.silent = truth, noise, silent
        self.rng = random.Random(seed)
        self.calls = 0

    def __call__(self, env):  # the engine's factory
        return self

    def propose(self, rows):
        self.calls += 1
        out = []
        for r in rows:
            true = self.truth.get(r.request_id, ())[len(r.tokens) : len(r.tokens) + r.k]
            if self.rng.random() < self.silent:
                out.append([])
                continue
            out.append([t if self.rng.random() >= self.noise else self.rng.randrange(VOCAB) for t in true])
        return out

    def add_history(self, prompt, tokens):
        pass

    def release(self, request_id):
        pass

    def load(self, version, model):
        pass

    def drop(self, version):
        pass

    def train(self, budget_s):
        return None


class Garbage(Scripted):
    """Always k random tokens (ids out of the vocabulary too): costs time, must change nothing."""

    def propose(self, rows):
        return [[self.rng.randrange(-3, VOCAB + 3) for _ in range(r.k)] for r in rows]


def _reqs(n=10, seed=3):
    g = random.Random(seed)
    out = []
    for i in range(n):
        params = dict(temperature=(1.0, 0.0, 0.7)[i % 3], top_k=(0, 0, 20)[i % 3])
        if i % 4 == 1:
            params.update(stop_token_ids=(7, 11), min_new_tokens=3)
        out.append(req(f"q{i}", g.randint(1, 30), g.randint(1, 70), **params))
    return out


def _same(a, b, tol):
    assert [r.request_id for r in a] == [r.request_id for r in b]
    for x, y in zip(a, b):
        assert (x.token_ids, x.versions, x.finish) == (y.token_ids, y.versions, y.finish), x.request_id
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0) <= tol, x.request_id


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "drafter", ["oracle", "noisy", "garbage", "history", "quant8", "quant4", "trained", "trained2"]
)
def test_seeded_outputs_identical_with_and_without_speculation(model, dtype, drafter):
    """Mixed batches: requests of every sampling kind (greedy, tempered, top-k, stop tokens under
    min_new_tokens) through fewer slots than requests, so rows draft while others prefill or decode
    plainly (the noisy drafter is silent a third of the time)."""
    reqs = _reqs()
    plain = TailraceEngine(model, num_slots=4, prefill_tokens=16, dtype=dtype).generate(reqs)
    truth = {r.request_id: r.token_ids for r in plain}
    spec = {
        "oracle": Scripted(truth),
        "noisy": Scripted(truth, noise=0.3, silent=0.3),
        "garbage": Garbage(truth),
        "history": "history",
        "quant8": "quant8",
        "quant4": "quant4",
        "trained": "trained",
        "trained2": "trained2",
    }[drafter]
    eng = TailraceEngine(model, num_slots=4, prefill_tokens=16, dtype=dtype, spec=spec)
    if drafter == "history":  # an earlier "epoch": the same prompts' responses under other seeds
        for r in TailraceEngine(model, num_slots=4, dtype=dtype).generate(_reqs(seed=3)[:5]):
            pass
        for r, res in zip(reqs, plain):
            eng.add_history(r.prompt_ids, res.token_ids[::-1])  # the engine adds siblings it finishes
    if drafter.startswith("trained"):  # an earlier round of other seeds, learnt in idle time
        eng.generate(
            [
                dataclasses.replace(r, id=f"e{r.id}", params=dataclasses.replace(r.params, seed=9))
                for r in reqs
            ]
        )
        assert eng.idle(0.2) is not None
    v0, e0 = eng.spec_stats.verifies, eng.spec_stats.emitted
    _same(plain, eng.generate(reqs), TOL[dtype])
    st = eng.spec_stats
    assert st.verifies > v0 and st.emitted - e0 == sum(len(r.token_ids) for r in plain) - len(reqs)
    if drafter == "oracle":
        assert st.acceptance > 0.95 and st.passes_per_token < 0.5
    if drafter == "garbage":
        assert st.accepted <= st.drafted // 10
    if drafter == "quant8":  # int8 RTN rarely moves a perturbed argmax
        assert st.acceptance > 0.85 and st.draft_passes > 0


def test_quant_drafter_requantizes_at_every_weight_load():
    """Version 0 overwritten by another model: the self-drafter drafts from the new weights (its
    acceptance stays high; a stale copy of the old model would draft another model's tokens). Own
    models: a weight load writes the engine's model in place."""
    other = tiny_model(7)
    reqs = [req(f"w{i}", 4 + i, 40) for i in range(4)]
    plain = TailraceEngine(tiny_model(0), num_slots=4)
    eng = TailraceEngine(tiny_model(0), num_slots=4, spec="quant8")
    _same(plain.generate(reqs), eng.generate(reqs), TOL["float32"])
    plain.load_weights(other.state_dict(), 0)
    eng.load_weights(other.state_dict(), 0)
    before = eng.spec_stats.accepted, eng.spec_stats.compared
    _same(plain.generate(reqs), eng.generate(reqs), TOL["float32"])
    acc, cmp = eng.spec_stats.accepted - before[0], eng.spec_stats.compared - before[1]
    assert cmp > 0 and acc / cmp > 0.85


def test_torch_backend_gives_the_same_tokens(model):
    reqs = _reqs(6)
    plain = TailraceEngine(model, num_slots=4, attention="bmm").generate(reqs)
    truth = {r.request_id: r.token_ids for r in plain}
    eng = TailraceEngine(model, num_slots=4, attention="bmm", spec=Scripted(truth, noise=0.2))
    _same(plain, eng.generate(reqs), 1e-4)
    assert eng.spec_stats.accepted > 0


@pytest.mark.parametrize("spec", ["noisy", "history"])
def test_torch_backend_bf16_above_the_upcast_batch(model, spec):
    """bf16 on the torch backend (CUDA's) at up to 16 rows: its decode attention above
    `UPCAST_MAX_BATCH` rows ran in bf16 while verified tokens attend, as prefill pieces, in fp32, so
    drafts changed tokens (1 request in 24 here; on an H200, at batch 64). A speculating engine is
    batch-invariant: its tokens are those of a plain engine built batch-invariant (logprobs within
    bf16 noise: prefill pieces attend in fp32 on the cache, decode rows on fp32 copies, in another
    order)."""
    reqs = [req(f"u{i}", 3 + i % 7, 60, temperature=1.0) for i in range(24)]
    plain = TailraceEngine(model, num_slots=16, attention="bmm", dtype="bf16", batch_invariant=True).generate(
        reqs
    )
    truth = {r.request_id: r.token_ids for r in plain}
    eng = TailraceEngine(
        model, num_slots=16, attention="bmm", dtype="bf16",
        spec=Scripted(truth, noise=0.3) if spec == "noisy" else "history",
    )  # fmt: skip
    if spec == "history":
        for r, res in zip(reqs, plain):
            eng.add_history(r.prompt_ids, res.token_ids[::-1])
    _same(plain, eng.generate(reqs), 2e-2)
    assert eng.spec_stats.accepted > 0


def test_versions_and_weight_updates(model):
    """Two versions in one batch (one forward each, drafts in both), then version 0 overwritten in
    place between runs: each request matches the plain engine holding the same weights."""
    other = tiny_model(7)
    reqs = [req(f"v{i}", 4 + i, 40, version=i % 2) for i in range(6)]
    plain = TailraceEngine(model, num_slots=6)
    plain.load_weights(other.state_dict(), 1)
    want = plain.generate(reqs)
    truth = {r.request_id: r.token_ids for r in want}
    drafter = Scripted(truth, noise=0.2)
    eng = TailraceEngine(tiny_model(0), num_slots=6, spec=drafter)
    eng.load_weights(other.state_dict(), 1)
    _same(want, eng.generate(reqs), TOL["float32"])
    assert {r.versions[0] for r in want} == {0, 1}
    plain.load_weights(other.state_dict(), 0)
    eng.load_weights(other.state_dict(), 0)
    want = plain.generate(reqs)
    drafter.truth = {r.request_id: r.token_ids for r in want}
    _same(want, eng.generate(reqs), TOL["float32"])


def test_abort_and_resume_mid_draft(model):
    reqs = [req(f"a{i}", 5 + i, 50) for i in range(4)]
    full = {r.request_id: r for r in TailraceEngine(model, num_slots=4).generate(reqs)}
    truth = {k: r.token_ids for k, r in full.items()}
    eng = TailraceEngine(model, num_slots=4, spec=Scripted(truth, noise=0.25))
    for r in reqs:
        eng.add(r)
    for _ in range(6):
        eng.step()
    parts = [eng.abort(r.id) for r in reqs[:2]]
    assert all(0 < len(p.token_ids) < 50 for p in parts)
    for p in parts:
        assert p.token_ids == full[p.request_id].token_ids[: len(p.token_ids)]
    resumed = [
        GenRequest(r.id, r.prompt_ids, r.params, r.version, p.token_ids, p.logprobs, p.versions)
        for r, p in zip(reqs, parts)
    ]
    while eng.num_running or eng.num_waiting:
        eng.step()
    again = eng.generate(resumed)
    _same([full[r.id] for r in reqs[:2]], again, TOL["float32"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_preemption_under_speculation(dtype):
    """A pool far too small for the batch: drafts take only spare blocks, rows are preempted and
    re-prefilled, and outputs still match (fp32: a re-prefilled k/v comes from another batch shape)."""
    model = tiny_model(0)
    reqs = _reqs(12, seed=5)
    want = TailraceEngine(model, num_slots=6, max_context=96, dtype=dtype).generate(reqs)
    truth = {r.request_id: r.token_ids for r in want}
    dt = getattr(torch, dtype)
    budget = 40 * 4 * KVCache.token_bytes(model, dt) / GIB
    eng = TailraceEngine(
        model, num_slots=6, max_context=96, block_size=4, kv_memory_gb=budget, dtype=dtype,
        spec=Scripted(truth, noise=0.2),
    )  # fmt: skip
    _same(want, eng.generate(reqs), 1e-4 if dtype == "float32" else 0.0)
    assert eng.preemptions >= 3 and eng.spec_stats.accepted > 0
    assert eng.paging.num_holders == 0 and eng.paging.pool.num_free == eng.cache.num_blocks


def _snapshots(eng: TailraceEngine, reqs) -> dict:
    """Per (request, tokens generated): its block list and the k/v of every position it holds written,
    taken after every step; the pool's free stack when it is alone."""
    for r in reqs:
        eng.add(r)
    snaps = {}
    while eng.num_running or eng.num_waiting:
        eng.step()
        step = eng._decode_step
        for rid, row in eng.slots.row.items():
            seq = eng._seqs[rid]
            if not eng.slots.is_decoding(rid):
                continue
            n = seq.num_new(step)
            live = seq.pos_key + step  # positions [0, live) are written
            blocks = list(eng.paging.pool.owned[rid])
            kv = [read_kv(eng.cache, layer, row, live) for layer in range(len(eng.cache.k))]
            free = list(eng.paging.pool._free) if len(reqs) == 1 else None
            snaps[rid, n] = (blocks, kv, free, live)
    return snaps


@pytest.mark.parametrize("alone", [True, False])
def test_kv_rollback_leaves_the_cache_as_decoding_only_the_accepted_tokens(alone):
    """bf16 (bit-exact): after every step of the speculating engine, each request's cache holds
    exactly the blocks of the positions written (the rejected drafts' blocks freed) with the k/v plain
    decoding wrote there, compared at the same number of tokens. Alone, even the block ids and the
    pool's free stack match."""
    model = tiny_model(0)
    reqs = [req(f"k{i}", 3 + 5 * i, 60 - 9 * i, min_new_tokens=0) for i in range(1 if alone else 4)]
    kw = dict(num_slots=4, max_context=96, block_size=4, dtype="bfloat16")
    plain_eng = TailraceEngine(model, **kw)
    plain = _snapshots(plain_eng, reqs)
    truth = {}
    for (rid, n), _ in plain.items():
        truth[rid] = truth.get(rid, ())
    ref = TailraceEngine(model, **kw).generate(reqs)
    truth = {r.request_id: r.token_ids for r in ref}
    drafter = Scripted(truth, noise=0.3, seed=1)
    spec_eng = TailraceEngine(model, **kw, spec=drafter)
    spec = _snapshots(spec_eng, reqs)
    assert spec_eng.spec_stats.accepted > 10 and spec_eng.spec_stats.accepted < spec_eng.spec_stats.drafted
    assert set(spec) < set(plain) and len(spec) < len(plain)  # it skipped counts: several tokens a step
    bs = 4
    for key, (blocks, kv, free, live) in spec.items():
        p_blocks, p_kv, p_free, p_live = plain[key]
        assert live == p_live and len(blocks) == -(-live // bs) == len(p_blocks)
        for (k, v), (pk, pv) in zip(kv, p_kv):
            assert torch.equal(k, pk) and torch.equal(v, pv)
        if alone:
            assert blocks == p_blocks and free == p_free
    assert spec_eng.paging.pool.num_free == spec_eng.cache.num_blocks


def test_history_drafter_drafts_from_finished_siblings_and_given_history(model):
    """Greedy siblings of one prompt are identical: the first to finish feeds the others' drafts."""
    p = req("s0", 6, 40, temperature=0.0).prompt_ids
    reqs = [GenRequest(f"s{i}", p, req("x", 1, 40, temperature=0.0).params) for i in range(3)]
    eng = TailraceEngine(model, num_slots=1, spec="history")
    out = eng.generate(reqs)
    assert len({r.token_ids for r in out}) == 1
    st = eng.spec_stats
    assert st.accepted > 40 and st.passes_per_token < 0.7  # s1, s2 drafted from s0
    eng2 = TailraceEngine(model, num_slots=2, spec="history")
    eng2.add_history(p, out[0].token_ids)
    eng2.generate(reqs[:2])
    assert eng2.spec_stats.accepted >= 60
    assert eng.capabilities.speculative and "history" in DRAFTERS


def test_a_row_the_drafter_has_nothing_for_is_never_asked(model, monkeypatch):
    """The history drafter says up front that a prompt without history gets no draft: the engine asks
    it (and copies response tokens off the device) only for the rows of the prompt it has history
    for (b0 and b1 finish together: neither has the other's response to draft from); nothing changes
    in the outputs."""
    a = [req(f"a{i}", 6, 40, pseed=1, temperature=0.0) for i in range(2)]
    b = [req(f"b{i}", 6, 40, pseed=2, seed=i) for i in range(2)]
    plain = TailraceEngine(model, num_slots=4).generate(a + b)
    eng = TailraceEngine(model, num_slots=4, spec="history")
    eng.add_history(a[0].prompt_ids, plain[0].token_ids)
    assert eng._spec.budget(b[0].prompt_ids, 5) == 0 and eng._spec.budget(a[0].prompt_ids, 5) == 5
    asked, copied, drafting = [], [], []
    propose, outputs, draft = eng._spec.drafter.propose, eng.rows.outputs, eng._draft

    def copy(rows, *args):  # the requests whose tokens are read off the device to draft
        if drafting:
            owner = {row: rid for rid, row in eng.slots.row.items()}
            copied.extend(owner[r] for r in rows)
        return outputs(rows, *args)

    def step_draft(active):
        drafting.append(active)
        try:
            return draft(active)
        finally:
            drafting.pop()

    monkeypatch.setattr(eng._spec.drafter, "propose", lambda rows: asked.extend(rows) or propose(rows))
    monkeypatch.setattr(eng.rows, "outputs", copy)
    monkeypatch.setattr(eng, "_draft", step_draft)
    _same(plain, eng.generate(a + b), TOL["float32"])
    assert {r.request_id for r in asked} == {"a0", "a1"} and eng.spec_stats.accepted >= 30
    assert set(copied) == {"a0", "a1"}


def test_step_events_count_drafts_and_tokens(model):
    reqs = [req(f"e{i}", 4, 30) for i in range(3)]
    want = TailraceEngine(model, num_slots=3).generate(reqs)
    eng = TailraceEngine(model, num_slots=3, spec=Scripted({r.request_id: r.token_ids for r in want}))
    for r in reqs:
        eng.add(r)
    events = []
    while eng.num_running or eng.num_waiting:
        events.append(eng.step())
    assert sum(e.decode_tokens for e in events) == 90
    assert sum(e.verifies for e in events) == eng.spec_stats.verifies > 0
    assert sum(e.accepted for e in events) == eng.spec_stats.accepted == eng.spec_stats.drafted
    assert all(r.finish == Finish.LENGTH for e in events for r in e.finished)
    st = eng.spec_stats
    assert st.row_steps == sum(e.active for e in events) and st.emitted == 87
    assert set(st.on_fraction()) <= {1, 2, 3} and st.gamma == 5
    assert [e.by_version for e in events if e.verifies] == [
        ((0, e.drafted, e.accepted),) for e in events if e.verifies
    ]
    assert st.by_version == {0: [st.drafted, st.accepted, st.compared]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trained_drafter_across_weight_updates(dtype):
    """Two versions in one batch, the drafter trained in idle time between runs, then version 0
    overwritten in place: each request matches the plain engine holding the same weights, and the
    drafts are booked per version."""
    other = tiny_model(7)
    reqs = [req(f"v{i}", 4 + i, 40, version=i % 2) for i in range(6)]
    plain = TailraceEngine(tiny_model(0), num_slots=4, dtype=dtype)
    eng = TailraceEngine(tiny_model(0), num_slots=4, dtype=dtype, spec="trained")
    for e in (plain, eng):
        e.load_weights(other.state_dict(), 1)
    _same(plain.generate(reqs), eng.generate(reqs), TOL[dtype])
    assert eng.idle(0.2) is not None
    _same(plain.generate(reqs), eng.generate(reqs), TOL[dtype])
    for e in (plain, eng):
        e.load_weights(tiny_model(3).state_dict(), 0)
    _same(plain.generate(reqs), eng.generate(reqs), TOL[dtype])
    by = eng.spec_stats.by_version
    assert set(by) == {0, 1} and all(d > 0 for d, _, _ in by.values())


@pytest.mark.parametrize("attention", ["kernel", "bmm"])
def test_a_windowed_model_speculates_exactly_past_its_window(attention):
    """Gemma 3's layout with a window of 8 (sliding and full layers), sequences several windows long:
    drafts verified as prefill pieces attend to the same window as decoded tokens, so speculation's
    tokens and logprobs are the plain engine's (a quantized self-drafter's drafts, mostly accepted)."""
    if attention == "kernel" and ckernel.unavailable():
        pytest.skip("no C compiler")
    model = tiny_model(
        0, model_type="gemma3_text", sliding_window=8, layer_types=("sliding_attention", "full_attention")
    )
    reqs = [req(f"w{i}", 3 + i, 40, temperature=1.0) for i in range(6)]
    plain = TailraceEngine(model, num_slots=4, attention=attention).generate(reqs)
    eng = TailraceEngine(model, num_slots=4, attention=attention, spec="quant8")
    _same(plain, eng.generate(reqs), 1e-4)
    assert eng.spec_stats.accepted > 0


@pytest.mark.parametrize(
    "attention,drafter,moe",
    [(a, d, MOE) for a in ("kernel", "bmm") for d in ("quant8", "trained")]
    + [("kernel", "quant8", QWEN2_MOE), ("bmm", "trained", QWEN2_MOE)],
)
def test_a_mixture_of_experts_model_speculates_exactly(attention, drafter, moe):
    """Qwen3-MoE's layout (a sparse layer and a dense one): a drafted token verified as a prefill piece is
    routed to the experts a decoded one would be, so speculation's tokens and logprobs are the plain
    engine's, from a quantized self-drafter (its experts rounded, its router the policy's) and from a trained
    drafter (its one layer an MoE layer started from the policy's); Qwen2-MoE's, its shared expert with
    them."""
    if attention == "kernel" and ckernel.unavailable():
        pytest.skip("no C compiler")
    model = tiny_model(0, **moe)
    reqs = [req(f"m{i}", 3 + i, 40, temperature=1.0) for i in range(6)]
    plain = TailraceEngine(model, num_slots=4, attention=attention).generate(reqs)
    eng = TailraceEngine(model, num_slots=4, attention=attention, spec=drafter)
    if drafter == "trained":
        eng.generate(
            [
                dataclasses.replace(r, id=f"e{r.id}", params=dataclasses.replace(r.params, seed=9))
                for r in reqs
            ]
        )
        assert eng.idle(0.2) is not None
    _same(plain, eng.generate(reqs), 1e-4)
    assert eng.spec_stats.verifies > 0
