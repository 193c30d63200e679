"""What the engine generates: logprobs, greedy parity with Hugging Face, batch invariance, stop rules."""

from __future__ import annotations

import math

import pytest
import torch

from tailrace.engine import TailraceEngine
from tailrace.model.checkpoint import save_pretrained
from tailrace.types import Finish, GenRequest, SamplingParams
from tests.engine.engine_helpers import VOCAB, full_logprobs, prompt, req, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def test_logprobs_equal_full_sequence_forward(model):
    eng = TailraceEngine(model, num_slots=4, prefill_tokens=16)
    reqs = [
        req(f"a{i}", 3 + 7 * i, 12 + 5 * i, temperature=t) for i, t in enumerate([1.0, 0.7, 1.6, 1.0, 0.4])
    ]
    for r, res in zip(reqs, eng.generate(reqs)):
        assert len(res.token_ids) == r.params.max_new_tokens and res.finish == Finish.LENGTH
        ref = full_logprobs(model, r.prompt_ids, res.token_ids, r.params.temperature)
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref)) < 1e-4
        assert res.versions == (0,) * len(res.token_ids)


def test_greedy_matches_hugging_face_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(1, eos_token_id=None)
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    eng = TailraceEngine(model, num_slots=3, prefill_tokens=8)
    reqs = [req(f"g{i}", n, 24, temperature=0.0) for i, n in enumerate([1, 5, 17, 40])]
    results = eng.generate(reqs)
    for r, res in zip(reqs, results):
        out = hf.generate(
            torch.tensor([r.prompt_ids]),
            attention_mask=torch.ones(1, len(r.prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=24,
            min_new_tokens=24,
            pad_token_id=0,
        )
        assert res.token_ids == tuple(out[0, len(r.prompt_ids) :].tolist())
        # greedy logprobs are under the untempered softmax
        ref = full_logprobs(model, r.prompt_ids, res.token_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref)) < 1e-4


def test_continuous_batching_equals_running_alone(model):
    """40 requests of mixed prompt/response lengths through 5 slots (a small prefill budget, so long
    prompts are chunked over several steps) get exactly the tokens each gets alone."""
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 60, (40,), generator=g).tolist()
    news = torch.randint(1, 40, (40,), generator=g).tolist()
    reqs = [
        req(f"c{i}", n, m, temperature=1.0, top_k=(0, 20)[i % 2], top_p=(1.0, 0.9)[i % 3 == 0])
        for i, (n, m) in enumerate(zip(lens, news))
    ]
    eng = TailraceEngine(model, num_slots=5, prefill_tokens=24)
    batched = eng.generate(reqs)
    for r, res in zip(reqs[:12], batched[:12]):
        alone = TailraceEngine(model, num_slots=1).generate([r])[0]
        assert alone.token_ids == res.token_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, res.logprobs)) < 1e-4
    assert [len(r.token_ids) for r in batched] == news


def test_long_tail_with_chunked_attention_and_row_sorting_equals_running_alone(model, monkeypatch):
    """Long-tailed lengths through 16 slots: the decode rows get re-sorted by length and their
    attention cut into chunks; every request still gets its solo tokens."""
    from tailrace.engine.slots import Slots

    calls = []
    orig = Slots.reorder
    monkeypatch.setattr(
        Slots, "reorder", lambda self, v, order: calls.append(len(order)) or orig(self, v, order)
    )
    g = torch.Generator().manual_seed(7)
    news = torch.exp(torch.randn(48, generator=g) * 0.9 + 2.5).clamp(1, 150).long().tolist()
    reqs = [req(f"t{i}", 1 + i % 7, m, temperature=1.0) for i, m in enumerate(news)]
    batched = TailraceEngine(model, num_slots=16, prefill_tokens=64).generate(reqs)
    assert calls, "expected at least one re-sort of the decode rows"
    for r, res in list(zip(reqs, batched))[::6]:
        assert TailraceEngine(model, num_slots=1).generate([r])[0].token_ids == res.token_ids
    assert [len(r.token_ids) for r in batched] == news


def test_unseeded_requests_follow_the_engine_seed(model):
    reqs = [GenRequest(f"u{i}", prompt(i, 6), SamplingParams(max_new_tokens=10)) for i in range(4)]
    a = TailraceEngine(model, num_slots=4, seed=11).generate(reqs)
    b = TailraceEngine(model, num_slots=2, seed=11).generate(reqs)
    c = TailraceEngine(model, num_slots=4, seed=12).generate(reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_stop_tokens_and_min_new_tokens(model):
    eng = TailraceEngine(model, num_slots=8)
    # greedy runs of this model revisit few tokens: stop on the 3rd generated token's id
    probe = eng.generate([req("p", 9, 20, temperature=0.0, pseed=1)])[0]
    stop_tok = probe.token_ids[2]
    first = probe.token_ids.index(stop_tok)
    res = eng.generate([req("s", 9, 20, temperature=0.0, pseed=1, stop_token_ids=(stop_tok,))])[0]
    assert res.finish == Finish.STOP and res.token_ids == probe.token_ids[: first + 1]
    # with min_new_tokens the stop token is masked until reached
    res = eng.generate(
        [req("m", 9, 20, temperature=0.0, pseed=1, stop_token_ids=(stop_tok,), min_new_tokens=first + 3)]
    )[0]
    assert stop_tok not in res.token_ids[: first + 3]
    assert res.finish == Finish.LENGTH or res.token_ids.index(stop_tok) == len(res.token_ids) - 1
    # sampled requests honour stop ids and min_new_tokens too (many stop ids: they stop early)
    stops = tuple(range(0, VOCAB, 3))
    out = eng.generate([req(f"x{i}", 4, 30, stop_token_ids=stops, min_new_tokens=5) for i in range(16)])
    for r in out:
        assert not set(r.token_ids[:5]) & set(stops)
        if r.finish == Finish.STOP:
            assert r.token_ids[-1] in stops and not set(r.token_ids[:-1]) & set(stops)
        else:
            assert len(r.token_ids) == 30
    assert sum(r.finish == Finish.STOP for r in out) >= 8


def test_top_k_top_p_in_engine_stay_in_allowed_set(model):
    reqs = [req(f"k{i}", 5, 12, top_k=4, top_p=0.7, temperature=1.2) for i in range(6)]
    for r, res in zip(reqs, TailraceEngine(model, num_slots=6).generate(reqs)):
        ids = torch.tensor([r.prompt_ids + res.token_ids])
        with torch.no_grad():
            logits = model(ids)[0, len(r.prompt_ids) - 1 : -1] / 1.2
        for t, lp, row in zip(res.token_ids, res.logprobs, logits):
            top = row.topk(4)
            p = torch.softmax(top.values, -1)
            n_keep = int(((p.cumsum(0) - p) < 0.7).sum())
            allowed = top.indices[:n_keep].tolist()
            assert t in allowed
            assert abs(lp - math.log(p[allowed.index(t)] / p[:n_keep].sum())) < 1e-4


def test_context_limit_ends_with_length(model):
    eng = TailraceEngine(model, num_slots=2, max_context=20)
    res = eng.generate([req("l", 15, 100), req("l2", 19, 100)])
    assert [len(r.token_ids) for r in res] == [5, 1] and all(r.finish == Finish.LENGTH for r in res)


def test_engine_sampling_matches_model_distribution(model):
    """First-token frequencies of 4,000 seeded requests vs softmax of the model's logits; chi-square
    over cells with expected count >= 5 (the rest pooled), critical value at the 1 - 1e-6 quantile
    (Wilson-Hilferty), so a false failure has probability about 1e-6."""
    p_ids = prompt(123, 5)
    N = 4000
    reqs = [
        GenRequest(f"d{i}", p_ids, SamplingParams(max_new_tokens=1, temperature=1.5, seed=i))
        for i in range(N)
    ]
    res = TailraceEngine(model, num_slots=64, prefill_tokens=1024).generate(reqs)
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in res]), minlength=VOCAB).double()
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([p_ids]))[0, -1].double() / 1.5, -1)
    e = N * p
    big = e >= 5
    obs, exp = counts[big], e[big]
    if not big.all():
        obs, exp = torch.cat([obs, counts[~big].sum()[None]]), torch.cat([exp, e[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    a = 2.0 / (9 * df)
    assert chi2 < df * (1 - a + 4.753 * math.sqrt(a)) ** 3, chi2


@pytest.mark.parametrize("kv", [None, torch.float32])
def test_bf16_engine_logprobs_close_to_fp32_forward(model, kv):
    """bf16 weights (bf16 or fp32 KV cache): logprobs within bf16 noise of the fp32 model."""
    eng = TailraceEngine(model, num_slots=4, dtype="bf16", kv_dtype=kv)
    assert eng.cache.dtype == (kv or torch.bfloat16) and eng.dtype == torch.bfloat16
    reqs = [req(f"b{i}", 4 + 6 * i, 16) for i in range(12)]
    for r, res in zip(reqs, eng.generate(reqs)):
        ref = full_logprobs(model, r.prompt_ids, res.token_ids)
        assert sum(abs(a - b) for a, b in zip(res.logprobs, ref)) / len(ref) < 0.05
