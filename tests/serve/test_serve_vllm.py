"""`tailrace serve --rollout.backend=vllm`: the same endpoint on a vLLM engine. Needs vLLM: skipped
where it does not import (CI); `make test-vllm` runs it."""

import pytest

pytest.importorskip("vllm")

from tailrace.config import load_config  # noqa: E402
from tests.chat_helpers import write_chat_model  # noqa: E402
from tests.serve.test_serve import TOKEN, call, post, serving  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # heads of 32: vLLM's CPU attention takes them
    d = write_chat_model(tmp_path_factory.mktemp("chat") / "model", "llama", max_position_embeddings=1024,
                         hidden_size=64, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    cfg = load_config(None, [f"--model.path={d}", "--serve.port=0", f"--serve.token={TOKEN}", "--serve.slots=8",
                             "--serve.context=256", "--serve.max_tokens=12", "--rollout.backend=vllm"])  # fmt: skip
    yield from serving(cfg, start_s=180)


def test_a_vllm_engine_serves_completions_and_chat_with_the_trainer_s_logprobs(server):
    """Seeded completions repeat; each token's logprob is the model's own (teacher-forced through
    tailrace's model, within fp32 rounding); chat goes through the template."""
    import torch

    from tailrace.model.checkpoint import load_pretrained

    srv, lines = server
    assert any("vLLM" in line for line in lines), lines
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 12, "seed": 3, "logprobs": 1}
    out = post(server, "/v1/completions", body)
    (c,) = out["choices"]
    assert out["policy_version"] == 0 and c["token_versions"] == [0] * len(c["token_ids"])
    assert post(server, "/v1/completions", body)["choices"][0]["token_ids"] == c["token_ids"]
    model = load_pretrained(srv.RequestHandlerClass.ep.model, dtype=torch.float32, device="cpu")
    ids = torch.tensor([[5, 6, 7, 8, *c["token_ids"]]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0, 3:-1].float(), -1)
    want = logp.gather(1, torch.tensor(c["token_ids"])[:, None])[:, 0]
    assert c["token_logprobs"] == pytest.approx(want.tolist(), abs=1e-4)
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 1})
    assert chat["choices"][0]["message"]["role"] == "assistant"
    status, _ = call(server, "/v1/completions", {"prompt": "1+2="}, token=None)
    assert status == 401
