import math

import pytest
import torch

from tailrace.trainer.logprobs import entropy_from_logits, token_logprobs


def test_hand_values():
    # logits [0, ln 3] -> softmax [1/4, 3/4]; at temperature 2 -> [0, ln3/2] -> [1/(1+√3), √3/(1+√3)]
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)]]])
    tgt = torch.tensor([[1, 0]])
    assert token_logprobs(logits, tgt)[0].tolist() == pytest.approx(
        [math.log(0.75), math.log(0.25)], abs=1e-6
    )
    s3 = math.sqrt(3)
    assert token_logprobs(logits, tgt, 2.0)[0].tolist() == pytest.approx(
        [math.log(s3 / (1 + s3)), math.log(1 / (1 + s3))], abs=1e-6
    )
    # H of [1/4, 3/4] = -(1/4 ln 1/4 + 3/4 ln 3/4)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(logits)[0].tolist() == pytest.approx([h, h], abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [None, 3])  # 3 rows per chunk over 2*5 rows: ragged last chunk
def test_matches_log_softmax_value_and_grad(temperature, chunk_rows):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 11, (2, 5), generator=g)
    w = torch.randn(2, 5, generator=g, dtype=torch.float64)
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, tgt[..., None]).squeeze(-1)
    (ref_grad,) = torch.autograd.grad((ref * w).sum(), logits)
    out = token_logprobs(logits, tgt, temperature, chunk_rows=chunk_rows)
    (grad,) = torch.autograd.grad((out * w).sum(), logits)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)
    ent = -(torch.softmax(logits / temperature, -1) * torch.log_softmax(logits / temperature, -1)).sum(-1)
    (ent_grad,) = torch.autograd.grad((ent * w).sum(), logits)
    out = entropy_from_logits(logits, temperature, chunk_rows=chunk_rows)
    (grad,) = torch.autograd.grad((out * w).sum(), logits)  # the entropy bonus trains through it
    torch.testing.assert_close(out, ent, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, ent_grad, atol=1e-12, rtol=0)


def test_bf16_logits_give_fp32_logprobs_and_bf16_grad():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 50, generator=g).to(torch.bfloat16).requires_grad_(True)
    tgt = torch.randint(0, 50, (3, 4), generator=g)
    out = token_logprobs(logits, tgt)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, tgt[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref.detach(), atol=1e-6, rtol=0)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_rejects_zero_temperature():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), 0.0)
