"""An external agent that trains a tailrace run over HTTP (flow.mode=external).

    tailrace train --flow.mode=external --serve.token=SECRET --run-dir=runs/agent &
    python examples/external_agent.py runs/agent --token SECRET

It reads the run's endpoint from RUN/endpoint.json, asks for `samples_per_prompt` completions of each
chainsum question (`n`), scores them with the task's own reward — any scorer would do: a tool-using
episode, a judge, unit tests — and sends them back as a group (POST /v1/groups), `--concurrency`
questions at a time, until the run stops taking groups. Only the standard library talks to the run;
tailrace is imported for the task's questions and reward alone.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import threading
import time
from pathlib import Path

from tailrace.tasks.registry import make_task


def post(url: str, path: str, body: dict, token: str) -> tuple[int, dict]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", f"/v1{path}", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})  # fmt: skip
    resp = conn.getresponse()
    out = json.loads(resp.read().decode())
    conn.close()
    return resp.status, out


def agent(run: Path, token: str, n: int, concurrency: int, task_name: str, seed: int) -> dict:
    while not (run / "endpoint.json").exists():
        time.sleep(0.2)
    url = json.loads((run / "endpoint.json").read_text())["url"]
    task = make_task(task_name)
    questions = iter(task.stream("train", seed=seed))
    lock, stats = threading.Lock(), {"groups": 0, "refused": 0, "reward": 0.0}
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                ex = next(questions)
            try:
                st, out = post(url, "/completions", {"prompt": ex.question, "n": n}, token)
                if st != 200:
                    return stop.set()  # the run ended (or refused us: the message says why)
                rewards = [task.reward(ex, c["text"]) for c in out["choices"]]
                ids = [c["completion_id"] for c in out["choices"]]
                st, got = post(url, "/groups", {"completions": ids, "rewards": rewards}, token)
            except (ConnectionError, OSError):
                return stop.set()  # the run shut its endpoint down
            with lock:
                if st == 200:
                    stats["groups"] += 1
                    stats["reward"] += sum(rewards) / len(rewards)
                else:
                    stats["refused"] += 1
                    if "ended" in got["error"]["message"] or "all its steps" in got["error"]["message"]:
                        stop.set()

    threads = [threading.Thread(target=worker, daemon=True) for _ in itertools.repeat(None, concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the run directory of a tailrace train --flow.mode=external")
    ap.add_argument("--token", required=True, help="the run's serve.token")
    ap.add_argument(
        "--n", type=int, default=8, help="completions a question: the run's flow.samples_per_prompt"
    )
    ap.add_argument("--concurrency", type=int, default=16, help="questions in flight at once")
    ap.add_argument("--task", default="chainsum", help="the questions and reward (a tailrace task name)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    stats = agent(a.run, a.token, a.n, a.concurrency, a.task, a.seed)
    mean = stats["reward"] / max(1, stats["groups"])
    print(f"groups sent {stats['groups']}, refused {stats['refused']}, mean reward {mean:.3f}")


if __name__ == "__main__":
    main()
