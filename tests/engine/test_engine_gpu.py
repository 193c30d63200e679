"""The engine on CUDA agrees with itself on the CPU (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tailrace.engine import TailraceEngine
from tests.engine.engine_helpers import full_logprobs, req, tiny_model

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
