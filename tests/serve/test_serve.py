"""`tailrace serve` for real: an HTTP server on loopback over a small random chat model; requests
through http.client as an agent framework would send them."""

import http.client
import json
import math
import socket
import threading

import pytest

from tailrace.config import load_config
from tailrace.serve import serve
from tests.chat_helpers import THINKING, write_chat_model

TOKEN = "test-token-123"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = write_chat_model(
        tmp_path_factory.mktemp("chat") / "model", "llama", THINKING, max_position_embeddings=32768
    )
    cfg = load_config(None, [f"--model.path={d}", "--serve.port=0", f"--serve.token={TOKEN}", "--serve.slots=8",
                             "--serve.context=256", "--serve.max_tokens=12"])  # fmt: skip
    yield from serving(cfg)


def serving(cfg, start_s: float = 60):
    """`tailrace serve` of `cfg` in a thread, for a fixture: yields (its server, the lines it said)."""
    up, lines, box = threading.Event(), [], {}

    def ready(srv):
        box["server"] = srv
        up.set()

    t = threading.Thread(target=serve, args=(cfg, lines.append), kwargs={"ready": ready}, daemon=True)
    t.start()
    assert up.wait(start_s), lines
    yield box["server"], lines
    box["server"].shutdown()
    t.join(timeout=10)


def call(server, path, body=None, token=TOKEN, raw=None):
    srv, _ = server
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=60)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (None if body is None else json.dumps(body))
    conn.request("GET" if data is None else "POST", path, body=data, headers=headers)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


def post(server, path, body):
    status, text = call(server, path, body)
    assert status == 200, text
    return json.loads(text)


def test_it_says_where_it_listens_and_how_to_call_it(server):
    srv, lines = server
    port = srv.server_address[1]
    assert any(f"on http://127.0.0.1:{port}/v1" in line for line in lines), lines
    assert any("curl" in line and TOKEN in line for line in lines)
    status, text = call(server, "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["object"] == "model"


def test_a_completion_carries_what_a_trainer_needs(server):
    out = post(server, "/v1/completions", {"prompt": "1+2=", "max_tokens": 10, "seed": 7, "logprobs": 1})
    (c,) = out["choices"]
    assert out["object"] == "text_completion" and out["policy_version"] == 0
    assert 1 <= len(c["token_ids"]) <= 10 and len(c["token_logprobs"]) == len(c["token_ids"])
    assert c["token_versions"] == [0] * len(c["token_ids"])
    assert all(math.isfinite(x) and x <= 0 for x in c["token_logprobs"])
    assert c["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] == len(c["token_ids"])
    assert out["usage"]["prompt_tokens"] == len(out["prompt_token_ids"]) == 4  # characters, no BOS
    again = post(server, "/v1/completions", {"prompt": "1+2=", "max_tokens": 10, "seed": 7})
    assert again["choices"][0]["token_ids"] == c["token_ids"]  # a seed fixes the tokens


def test_served_tokens_are_the_engines_own(server):
    """The same seeded request straight through an engine of the same model gives the same tokens and
    logprobs: the endpoint adds nothing and drops nothing."""
    import torch

    from tailrace.engine import build_engine
    from tailrace.model.checkpoint import load_pretrained
    from tailrace.types import GenRequest, SamplingParams

    srv, _ = server
    ep = srv.RequestHandlerClass.ep
    out = post(
        server, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 12, "seed": 3, "temperature": 0.8}
    )
    (c,) = out["choices"]
    model = load_pretrained(ep.model, dtype=torch.float32, device="cpu")
    engine = build_engine(model, num_slots=2, seed=0, max_context=256)
    sp = SamplingParams(temperature=0.8, max_new_tokens=12, stop_token_ids=ep.text.stop_ids, seed=3)
    (r,) = engine.generate([GenRequest("x", (5, 6, 7, 8), sp)])
    assert c["token_ids"] == list(r.token_ids)
    assert c["token_logprobs"] == pytest.approx(list(r.logprobs), abs=1e-6)


def test_n_choices_and_concurrent_clients_are_batched_and_stay_seeded(server):
    alone = [post(server, "/v1/completions", {"prompt": f"{i}+1=", "seed": i, "n": 2}) for i in range(4)]
    together = [None] * 4

    def one(i):
        together[i] = post(server, "/v1/completions", {"prompt": f"{i}+1=", "seed": i, "n": 2})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for a, b in zip(alone, together):
        assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
        assert len(a["choices"]) == 2 and [c["index"] for c in a["choices"]] == [0, 1]


def test_chat_renders_the_template_and_stops_at_the_end_of_turn(server):
    srv, _ = server
    ep = srv.RequestHandlerClass.ep
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    out = post(server, "/v1/chat/completions", {"messages": msgs, "seed": 1, "max_tokens": 40})
    (c,) = out["choices"]
    assert out["object"] == "chat.completion" and c["message"]["role"] == "assistant"
    assert out["prompt_token_ids"] == ep.text.tok.encode(ep.text.chat.render_turns(msgs))
    assert out["prompt_token_ids"][0] == 1  # <|im_start|>: the template's own, never a second BOS
    if c["finish_reason"] == "stop":
        assert c["token_ids"][-1] in ep.text.stop_ids and "<|im_end|>" not in c["message"]["content"]


def test_a_chat_request_sets_the_templates_thinking_switch(server):
    """chat_template_kwargs {enable_thinking: false}, as vLLM's server takes it: the prompt closes an
    empty think block (Qwen3's templates); a template without the switch refuses it."""
    srv, _ = server
    chat = srv.RequestHandlerClass.ep.text.chat
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    body = {"messages": msgs, "seed": 1, "max_tokens": 4, "chat_template_kwargs": {"enable_thinking": False}}
    out = post(server, "/v1/chat/completions", body)
    assert out["prompt_token_ids"] == chat.tok.encode(chat.render_turns(msgs, False))
    assert chat.render_turns(msgs, False).endswith("<think>\n\n</think>\n\n")
    chat.switch = False  # as a template without it
    try:
        status, text = call(server, "/v1/chat/completions", body)
    finally:
        chat.switch = True
    assert status == 400 and "has no enable_thinking switch" in text, text


def sse(server, path, body):
    srv, _ = server
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=60)
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events = [line[6:] for line in resp.read().decode().split("\n") if line.startswith("data: ")]
    conn.close()
    return events


@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_a_stream_sends_each_token_once_and_adds_up_to_the_whole_response(server, path, field):
    prompt = "3+4=" if field == "prompt" else [{"role": "user", "content": "3+4?"}]
    body = {field: prompt, "seed": 5, "max_tokens": 12, "n": 2}
    whole = post(server, path, body)
    events = sse(server, path, {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 2  # token by token, not one final message
    for i, want in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert sum((m["token_ids"] for m in mine), []) == want["token_ids"]
        assert sum((m["token_versions"] for m in mine), []) == want["token_versions"]
        text = "".join(m["delta"]["content"] if "delta" in m else m["text"] for m in mine)
        assert text == (want["message"]["content"] if "message" in want else want["text"])
        assert [m["finish_reason"] for m in mine][-1] == want["finish_reason"]


def test_a_client_that_leaves_mid_stream_has_its_request_aborted(server):
    srv, _ = server
    engine = srv.RequestHandlerClass.ep.loop.engine
    body = json.dumps({"prompt": "9+9=", "max_tokens": 200, "min_tokens": 200, "stream": True}).encode()
    s = socket.create_connection(srv.server_address[:2])
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
              + b"\r\n\r\n" + body)  # fmt: skip
    got = b""
    while b"data: " not in got:  # the headers, then the first token
        got += s.recv(4096)
    s.close()
    import time

    deadline = time.time() + 30
    while engine.num_running + engine.num_waiting and time.time() < deadline:
        time.sleep(0.05)
    assert engine.num_running + engine.num_waiting == 0  # aborted, not run to 200 tokens for no one


@pytest.mark.parametrize(
    "path,body,status,says",
    [
        ("/v1/completions", {"prompt": "x"}, 401, "Bearer"),  # no token (sent below)
        ("/v1/nope", {"prompt": "x"}, 404, "no route"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "token ids"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stop": ["\n"]}, 400, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "logprobs": 5}, 400, "sampled token"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "context"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": 1}},
            400,
            "only {enable_thinking",
        ),
    ],
)
def test_bad_requests_get_a_clear_error(server, path, body, status, says):
    got, text = call(server, path, body, token=None if status == 401 else TOKEN)
    assert got == status, text
    assert says in json.loads(text)["error"]["message"], text


def test_a_body_that_is_not_json_is_refused(server):
    status, text = call(server, "/v1/completions", raw="{not json")
    assert status == 400 and "not valid JSON" in text


def test_a_context_past_the_model_s_longrope_short_range_is_refused_in_one_line(tmp_path):
    """Phi-3.5's LongRoPE: serve.context may fill its short range, not pass it (past it the model rotates
    every position, cached keys included, by its long factors)."""
    from tailrace.common import ConfigError

    rope = {"rope_type": "longrope", "original_max_position_embeddings": 128,
            "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}  # fmt: skip
    d = write_chat_model(tmp_path / "model", "phi3", THINKING, rope_scaling=rope)
    cfg = load_config(None, [f"--model.path={d}", "--serve.port=0", "--serve.context=129"])
    with pytest.raises(ConfigError, match="serve.context=129 is past the model's LongRoPE") as e:
        serve(cfg, print)
    assert "set serve.context <= 128" in str(e.value)
