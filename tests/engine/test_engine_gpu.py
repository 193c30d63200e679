"""The engine on CUDA agrees with itself on the CPU (skipped without a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tailrace.engine import TailraceEngine
from tests.engine.engine_helpers import MOE, QWEN2_MOE, full_logprobs, req, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_engine_matches_cpu(dtype):
    model = tiny_model(0)
    reqs = [
        req(f"g{i}", 3 + 9 * i, 20, temperature=(0.0, 1.0)[i % 2], top_k=(0, 30)[i % 2]) for i in range(6)
    ]
    gpu = TailraceEngine(model, num_slots=4, prefill_tokens=16, device="cuda", dtype=dtype).generate(reqs)
    for r, res in zip(reqs, gpu):
        assert len(res.token_ids) == 20
        if dtype == torch.float32:
            cpu = TailraceEngine(model, num_slots=2).generate([r])[0]
            assert res.token_ids == cpu.token_ids
            if r.params.top_k == 0:
                ref = full_logprobs(model, r.prompt_ids, res.token_ids, r.params.temperature)
                assert max(abs(a - b) for a, b in zip(res.logprobs, ref)) < 1e-4


def _mismatch(plain, fast) -> str:
    """'' when every request got the same tokens, else how many did not and the largest logprob gap."""
    bad = [p.request_id for p, f in zip(plain, fast) if p.token_ids != f.token_ids]
    gap = max(
        (
            abs(x - y)
            for p, f in zip(plain, fast)
            if p.token_ids == f.token_ids
            for x, y in zip(p.logprobs, f.logprobs)
        ),
        default=0.0,
    )
    return (
        f"{len(bad)}/{len(plain)} requests differ ({bad[:4]}); largest logprob gap {gap:.2e}" if bad else ""
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drafter", ["oracle", "noisy", "history", "quant8", "trained"])
def test_cuda_speculation_is_lossless(dtype, drafter, monkeypatch):
    """On CUDA too a seeded request gets the tokens it gets without speculation, from an engine built
    batch-invariant as a speculating one is (every row drafts the ladder's length: the toggle's timings
    would decide what is exercised)."""
    from tailrace.engine.spec.costs import Toggle
    from tests.engine.test_spec_engine import Scripted, _reqs

    monkeypatch.setattr(Toggle, "gamma", lambda self, batch, alpha, gamma_max, veto=True: gamma_max)
    model = tiny_model(0).to("cuda")
    reqs = _reqs(24)  # through 16 slots: decode batches past the torch backend's UPCAST_MAX_BATCH

    def mk(spec=None):
        return TailraceEngine(
            model, num_slots=16, prefill_tokens=16, dtype=dtype, spec=spec, batch_invariant=True
        )

    plain = mk().generate(reqs)
    truth = {r.request_id: r.token_ids for r in plain}
    spec = {"oracle": Scripted(truth), "noisy": Scripted(truth, noise=0.3, silent=0.3)}.get(drafter, drafter)
    eng = mk(spec)
    assert eng.device.type == "cuda"
    if drafter == "history":
        for r, res in zip(reqs, plain):
            eng.add_history(r.prompt_ids, res.token_ids[::-1])
    if drafter == "trained":
        eng.generate(
            [
                dataclasses.replace(r, id=f"e{r.id}", params=dataclasses.replace(r.params, seed=9))
                for r in reqs
            ]
        )
        assert eng.idle(0.2) is not None
    fast = eng.generate(reqs)
    assert eng.spec_stats.verifies > 0
    assert not _mismatch(plain, fast), _mismatch(plain, fast)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert max(abs(x - y) for p, f in zip(plain, fast) for x, y in zip(p.logprobs, f.logprobs)) <= tol
    if drafter == "oracle":
        assert eng.spec_stats.acceptance > 0.95


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_mixed_adapter_batch_equals_each_adapter_alone(dtype, monkeypatch):
    """LoRA rows of three adapters and of none in one forward on CUDA (each token's adapter gathered),
    against each adapter's alone; bf16 decode attention pinned to its fp32 copies at every batch, as on
    the CPU (else the base model's own rows move by up to ~0.06 between batch sizes, adapter or not)."""
    from tailrace.engine.backends import torch_ref

    monkeypatch.setattr(torch_ref, "UPCAST_MAX_BATCH", 10**9)
    from tests.engine.test_engine_adapters import SPECS, adapted, mixed_and_alone

    base = tiny_model(seed=0)
    adapters = {n: adapted(base, n, seed) for seed, n in enumerate(SPECS, start=1)}
    mixed, alone = mixed_and_alone(
        base.to("cuda"), {n: m.to("cuda") for n, m in adapters.items()}, "bmm", dtype
    )
    order = sorted(alone)
    assert not _mismatch([alone[k] for k in order], [mixed[k] for k in order]), _mismatch(
        [alone[k] for k in order], [mixed[k] for k in order]
    )
    tol = 1e-4 if dtype == "fp32" else 2e-2
    assert max(abs(x - y) for k in order for x, y in zip(alone[k].logprobs, mixed[k].logprobs)) <= tol


def moe_routes_on(device: str, dtype: torch.dtype, moe: dict) -> None:
    """Routing replay's engine side on `device`: fp32 results carry the routes the model itself takes
    (the CPU model's, one forward over each sequence) and the CPU engine's tokens; bf16 results carry a
    valid expert at every position (which ones may differ from fp32's: the flips replay exists for)."""
    from tailrace.model.moe import routes_of
    from tests.engine.test_engine_routes import assert_own

    model = tiny_model(0, **moe)
    reqs = [req(f"m{i}", 3 + 5 * i, 24, temperature=1.0) for i in range(6)]
    got = TailraceEngine(
        model, num_slots=4, prefill_tokens=16, device=device, dtype=dtype, routes=True
    ).generate(reqs)
    if dtype == torch.float32:
        cpu = TailraceEngine(model, num_slots=4, prefill_tokens=16, routes=True).generate(reqs)
        assert [r.token_ids for r in got] == [r.token_ids for r in cpu]
        assert_own(model, reqs, got)
        return
    for r, res in zip(reqs, got):
        routes = routes_of(res.routes, model.config)
        assert routes.shape[0] == len(r.prompt_ids) + len(res.token_ids) - 1, r.id
        assert 0 <= int(routes.min()) and int(routes.max()) < moe["num_experts"], r.id


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_cuda_moe_results_carry_the_routes_the_model_takes(dtype, family):
    moe_routes_on("cuda", dtype, MOE if family == "qwen3_moe" else QWEN2_MOE)
