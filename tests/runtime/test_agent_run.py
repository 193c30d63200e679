"""An external agent trains a run (flow.mode=external) end to end: it finds the run's endpoint in
RUN/endpoint.json, asks for completions over HTTP as an agent framework would, scores them itself and
sends each prompt's completions back as a group; the run trains its steps on those groups, exact."""

import http.client
import json
import threading
import time
from pathlib import Path

from tailrace.cli import main
from tests.runtime.conftest import TINY_RUN

TOKEN = "agent-token-123"


def call(url: str, path: str, body: dict, token: str = TOKEN) -> tuple[int, dict]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", f"/v1{path}", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})  # fmt: skip
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    if resp.getheader("Content-Type") == "text/event-stream":
        return resp.status, {"events": [l[6:] for l in text.splitlines() if l.startswith("data: ")]}
    return resp.status, json.loads(text)


def train_beside(agent, model: Path, run: Path, steps: int) -> threading.Thread:
    """`tailrace train --flow.mode=external` for `steps` steps with `agent()` in a thread beside it; the
    run ends exact (every group trained once, the ledger whole). Returns the agent's thread."""
    from tests.runtime.conftest import assert_exact

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    argv = [
        "train", f"--run-dir={run}", f"--model.path={model}", *TINY_RUN, "--flow.mode=external",
        f"--flow.steps={steps}", "--eval.n=4", "--serve.port=0", f"--serve.token={TOKEN}", "--flow.zero_signal=train",
    ]  # fmt: skip
    assert main(argv) == 0
    t.join(timeout=60)
    assert_exact(run, steps=steps)
    return t


class Agent(threading.Thread):
    """Groups of 4 completions of one prompt, rewarded by the parity of their first token, until the
    run stops taking groups; it also tries what a careless agent would."""

    def __init__(self, run: Path, model: str | None = None, checks: bool = True):
        super().__init__(daemon=True)
        self.dir, self.groups, self.refused, self.checks = run, [], [], {}
        self.model, self.try_checks = model, checks

    def run_agent(self) -> None:
        while not (self.dir / "endpoint.json").exists():
            time.sleep(0.05)
        url = json.loads((self.dir / "endpoint.json").read_text())["url"]
        if self.try_checks:
            self.careless(url)
        named = {} if self.model is None else {"model": self.model}
        k = 0
        while True:
            body = {"prompt": f"{k % 9}+{k % 7}=", "n": 4, "max_tokens": 8, **named}
            st, out = call(url, "/completions", body)
            if st != 200:  # the run ended
                return
            ch = out["choices"]
            ids = [c["completion_id"] for c in ch]
            rewards = [float(c["token_ids"][0] % 2) for c in ch]
            st, got = call(url, "/groups", {"completions": ids, "rewards": rewards, **named})
            if st == 200:
                self.groups.append((got["group"], out["policy_version"]))
            else:
                self.refused.append(got["error"]["message"])
                if "all its steps" in got["error"]["message"]:
                    return
            if k == 1 and self.try_checks:  # the same completions again: refused, each trains once
                self.checks["twice"] = call(url, "/groups", {"completions": ids, "rewards": rewards, **named})
            k += 1

    def careless(self, url: str) -> None:
        """What a careless agent would try."""
        self.checks["no token"] = call(
            url, "/completions", {"prompt": "1+2=", "max_tokens": 4}, token="x" * 12
        )[0]
        self.checks["temperature"] = call(url, "/completions", {"prompt": "1+2=", "temperature": 0.5})
        st, streamed = call(url, "/completions", {"prompt": "1+2=", "max_tokens": 4, "stream": True})
        self.checks["stream"] = (st, streamed["events"][-1], json.loads(streamed["events"][0]))

    def run(self) -> None:
        try:
            self.run_agent()
        except (ConnectionError, OSError):  # the run shut its endpoint down mid-request
            pass


def test_an_external_agents_groups_train_a_run_exactly(tiny_model, tmp_path):
    from tests.runtime.conftest import assert_exact

    run = tmp_path / "run"
    agent = Agent(run)
    agent.start()
    argv = [
        "train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.mode=external",
        "--flow.steps=3", "--eval.n=4", "--serve.port=0", f"--serve.token={TOKEN}", "--train.loss.kl_coef=0.01",
    ]  # fmt: skip
    assert main(argv) == 0
    agent.join(timeout=60)
    assert_exact(run, steps=3)
    steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"kind":"step"' in l]
    assert [s["samples"] for s in steps] == [16, 16, 16]  # U = 4 groups of 4 completions a step
    assert len(agent.groups) >= 12 and max(v for _, v in agent.groups) >= 1  # later ones of newer weights
    assert agent.checks["no token"] == 401
    st, err = agent.checks["temperature"]
    assert st == 400 and "rollout.temperature=1.0" in err["error"]["message"]
    st, last, first = agent.checks["stream"]
    assert st == 200 and last == "[DONE]" and first["choices"][0]["token_ids"]
    st, err = agent.checks["twice"]
    assert st == 409 and "already in a group" in err["error"]["message"]
    assert not (run / "endpoint.json").exists()  # gone with the run


def test_an_external_run_refuses_shaping_and_one_version_engines_in_one_line():
    import pytest

    from tailrace.cli.choices import check
    from tailrace.common import ConfigError
    from tailrace.config.load import load_config

    with pytest.raises(ConfigError, match="with flow.mode=external the agent makes them"):
        check(load_config(None, ["--flow.mode=external", "--shaping.name=darts"]))
    with pytest.raises(ConfigError, match="flow.mode=external serves an agent's requests under the newest"):
        check(load_config(None, ["--flow.mode=external", "--rollout.max_versions=1"]))


def test_an_agent_trains_one_policy_of_a_run_beside_one_that_makes_its_own_groups(tiny_model, tmp_path):
    """A solver trained by an external agent (its requests name it as their model) beside a sync policy
    of the task's on the same engines: the endpoint lists both policies and refuses a model naming
    neither; both policies end exact, each its own steps."""
    from tests.runtime.conftest import assert_exact

    run = tmp_path / "run"
    agent = Agent(run, model="solver", checks=False)
    agent.start()
    argv = [
        "train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.mode=sync", "--flow.steps=2",
        "--eval.n=4", "--serve.port=0", f"--serve.token={TOKEN}", "--train.loss.kl_coef=0.01",
        "--policies=[{name: solver, flow: {mode: external}}, {name: sums}]",
    ]  # fmt: skip
    box = {}

    def probe():  # while the run lives: its models, and a request naming none of them
        while not (run / "endpoint.json").exists():
            time.sleep(0.05)
        url = json.loads((run / "endpoint.json").read_text())["url"]
        box["nope"] = call(url, "/completions", {"prompt": "1+2=", "max_tokens": 4, "model": "nope"})
        host, port = url.split("//")[1].split("/")[0].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
        box["models"] = [m["id"] for m in json.loads(conn.getresponse().read())["data"]]
        conn.close()

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    assert main(argv) == 0
    agent.join(timeout=60)
    t.join(timeout=10)
    for name in ("solver", "sums"):
        assert_exact(run / "policies" / name, steps=2)
    st, err = box["nope"]
    assert st == 400 and "name one of this run's policies: solver, sums" in err["error"]["message"]
    assert box["models"] == ["solver", "sums"] and len(agent.groups) >= 8


def test_an_agent_trains_a_chat_model_through_chat_completions(tmp_path):
    """A small random Llama whose tokenizer has a chat template: the agent's messages are rendered by
    the template (one BOS: the template's own), its completions stop at the end-of-turn token, and
    the groups it sends train the run's step."""
    from tailrace.chat import ChatFormat
    from tailrace.config import load_config
    from tailrace.runtime.session import Session
    from tests.chat_helpers import write_chat_model

    d = write_chat_model(tmp_path / "llama", "llama", max_position_embeddings=32768)
    run = tmp_path / "run"
    seen = {}

    def chat_agent():
        while not (run / "endpoint.json").exists():
            time.sleep(0.05)
        url = json.loads((run / "endpoint.json").read_text())["url"]
        for k in range(64):
            msgs = [{"role": "user", "content": f"What is {k % 9} + {k % 7}?"}]
            st, out = call(url, "/chat/completions", {"messages": msgs, "n": 4, "max_tokens": 16})
            if st != 200:
                return
            seen.setdefault("first", (msgs, out))
            ch = out["choices"]
            rewards = [float(c["token_ids"][0] % 2) for c in ch]
            st, _ = call(
                url, "/groups", {"completions": [c["completion_id"] for c in ch], "rewards": rewards}
            )
            if st != 200:
                return

    train_beside(chat_agent, d, run, steps=1)
    msgs, out = seen["first"]
    ses = Session(load_config(None, [f"--model.path={d}"]))
    try:
        want = ChatFormat(ses.tok).render_turns(msgs)
        assert out["prompt_token_ids"] == ses.tok.encode(want)  # the template's ids, no second BOS
    finally:
        ses.close()
    for c in out["choices"]:  # stopped at the end of its turn, or cut at max_tokens
        assert c["finish_reason"] == "length" or c["token_ids"][-1] in ses.stop_ids


def test_the_example_agent_trains_a_run(tiny_model, tmp_path, monkeypatch):
    """examples/external_agent.py as the README shows it: chainsum's questions and reward, over HTTP."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    from external_agent import agent

    run = tmp_path / "run"
    box = {}
    t = train_beside(lambda: box.update(agent(run, TOKEN, 4, 4, "chainsum", 0)), tiny_model, run, steps=2)
    assert box["groups"] >= 8 and not t.is_alive()


def test_an_agent_endpoint_on_a_port_in_use_fails_the_run_before_anything_starts(
    tiny_model, tmp_path, capsys
):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["train", f"--run-dir={tmp_path / 'run'}", f"--model.path={tiny_model}", *TINY_RUN,
                "--flow.mode=external", f"--serve.port={port}", f"--serve.token={TOKEN}"]  # fmt: skip
        assert main(argv) == 2
    out = capsys.readouterr()
    err = out.out + out.err
    assert f"serve.port={port}: the agent endpoint cannot listen there" in err and "0: any free one" in err
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))


def test_each_policy_s_chat_requests_render_with_its_own_system_prompt_a_joiner_s_too(tmp_path):
    """Two external policies of one chat model, each with its own task.system_prompt, the second joining
    the running run (tailrace policy join): a chat request naming a policy is rendered by that policy's
    chat format (not the first policy's), and the joiner is served and trained like the first; once
    the joiner has trained its steps, its requests are refused while the first policy goes on."""
    from tailrace.chat import ChatFormat
    from tailrace.config import load_config
    from tailrace.runtime.session import Session
    from tests.chat_helpers import write_chat_model
    from tests.runtime.conftest import assert_exact, run_cli

    d = write_chat_model(tmp_path / "llama", "llama", max_position_embeddings=32768)
    run, msgs, seen = tmp_path / "run", [{"role": "user", "content": "What is 2 + 3?"}], {}

    def chat(url, model):
        body = {"messages": msgs, "n": 4, "max_tokens": 8, "model": model}
        st, out = call(url, "/chat/completions", body)
        if st != 200:
            seen.setdefault(f"refused {model}", out["error"]["message"])
            return False
        seen.setdefault(model, out["prompt_token_ids"])
        ch = out["choices"]
        group = {"completions": [c["completion_id"] for c in ch], "model": model,
                 "rewards": [float(c["token_ids"][0] % 2) for c in ch]}  # fmt: skip
        st, got = call(url, "/groups", group)
        if st != 200:  # (the policy finished between its completions and its group)
            seen.setdefault(f"refused {model}", got["error"]["message"])
        return st == 200

    def agent():
        while not (run / "endpoint.json").exists():
            time.sleep(0.05)
        url = json.loads((run / "endpoint.json").read_text())["url"]
        chat(url, "a")
        seen["join"] = run_cli(
            "policy", "join", str(run), "b", "--task.system_prompt=You help.", "--flow.steps=1"
        )
        live = {"a", "b"}
        while live:
            live = {m for m in live if chat(url, m)}

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    argv = [
        "train", f"--run-dir={run}", f"--model.path={d}", *TINY_RUN, "--flow.mode=external", "--flow.steps=2",
        "--eval.n=4", "--serve.port=0", f"--serve.token={TOKEN}", "--flow.zero_signal=train", "--max_policies=2",
        "--policies=[{name: a, task: {system_prompt: You add.}}]",
    ]  # fmt: skip
    assert main(argv) == 0
    t.join(timeout=60)
    assert seen["join"].returncode == 0, seen["join"].stdout + seen["join"].stderr
    ses = Session(load_config(None, [f"--model.path={d}"]))
    try:
        for model, system in (("a", "You add."), ("b", "You help.")):
            assert seen[model] == ses.tok.encode(ChatFormat(ses.tok, system).render_turns(msgs)), model
    finally:
        ses.close()
    assert_exact(run / "policies" / "a", steps=2)
    assert_exact(run / "policies" / "b", steps=1)
    # b's one step trains first; its later requests are refused at once, not left waiting while a goes on
    assert (
        seen["refused b"]
        == "this policy has trained all its steps (flow.steps): it takes no more requests or groups"
    )
