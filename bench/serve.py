"""bench/serve.py: `tailrace serve` under concurrent clients, against the same engine called directly.

    .venv/bin/python bench/serve.py [--model DIR] [--dtype bfloat16] [--clients 1,4,16] [--tokens 64]

The server (loopback, port 0) on one engine, and in a second process client threads that each send one
seeded completion of exactly --tokens tokens (min_tokens = max_tokens) at a time, --requests in all
per concurrency level: closed-loop clients, so a client's next request waits for its last response
(the batch runs below --clients while responses travel). Then the same requests, as many at a time,
straight into an engine of the same model (`Engine.generate`, no HTTP). Printed per concurrency:
generated tokens/s both ways and their ratio (what HTTP, JSON, the engine thread's hand-offs and
the clients' round trips cost), the latency per request, and whether the served tokens equal the
direct ones (they must: same seeds).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tailrace.config import load_config  # noqa: E402
from tailrace.engine import build_engine  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.serve import serve  # noqa: E402
from tailrace.types import GenRequest, SamplingParams  # noqa: E402

TOKEN = "bench-serve-token"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def post(addr, body) -> dict:
    conn = http.client.HTTPConnection(*addr, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})  # fmt: skip
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out


def served(addr, clients: int, requests: int, tokens: int) -> tuple[float, list[float], dict]:
    """`clients_of` in a process of its own (its threads must not take the server's interpreter lock)."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_clients_main, args=(addr, clients, requests, tokens, q))
    p.start()
    out = q.get()
    p.join()
    return out


def _clients_main(addr, clients, requests, tokens, q) -> None:
    q.put(clients_of(addr, clients, requests, tokens))


def clients_of(addr, clients: int, requests: int, tokens: int) -> tuple[float, list[float], dict]:
    """tokens/s over `requests` completions sent by `clients` threads; latencies; seed -> token ids."""
    seeds = list(range(requests))
    lock, got, lat = threading.Lock(), {}, []

    def client():
        while True:
            with lock:
                if not seeds:
                    return
                seed = seeds.pop()
            t0 = time.perf_counter()
            out = post(addr, {"prompt": PROMPT, "max_tokens": tokens, "min_tokens": tokens, "seed": seed})
            with lock:
                lat.append(time.perf_counter() - t0)
                got[seed] = out["choices"][0]["token_ids"]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return requests * tokens / (time.perf_counter() - t0), lat, got


def direct(engine, clients: int, requests: int, tokens: int, stops: tuple[int, ...]) -> tuple[float, dict]:
    """The same requests (the server's stop ids: masked until min_tokens), `clients` at a time, through
    Engine.generate."""
    got = {}
    t0 = time.perf_counter()
    for lo in range(0, requests, clients):
        sp = [SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens, stop_token_ids=stops, seed=s)
              for s in range(lo, min(requests, lo + clients))]  # fmt: skip
        reqs = [GenRequest(f"r{lo + i}", tuple(PROMPT), p) for i, p in enumerate(sp)]
        for r, res in zip(reqs, engine.generate(reqs)):
            got[int(r.id[1:])] = list(res.token_ids)
    return requests * tokens / (time.perf_counter() - t0), got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a local HF checkpoint (default: the built-in model)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=96, help="completions per concurrency level")
    a = ap.parse_args()
    levels = [int(x) for x in a.clients.split(",")]
    keys = [f"--serve.token={TOKEN}", "--serve.port=0", f"--serve.slots={max(levels)}", f"--model.dtype={a.dtype}",
            f"--serve.context={len(PROMPT) + a.tokens + 16}"]  # fmt: skip
    keys += [f"--model.path={a.model}"] if a.model else []
    cfg = load_config(None, keys)
    box, up = {}, threading.Event()
    threading.Thread(
        target=serve,
        args=(cfg, lambda _: None),
        kwargs={"ready": lambda s: (box.update(s=s), up.set())},
        daemon=True,
    ).start()
    if not up.wait(600):
        sys.exit("the server did not start")
    srv = box["s"]
    addr = srv.server_address[:2]
    ep = srv.RequestHandlerClass.ep
    model = load_pretrained(ep.model, dtype=getattr(torch, a.dtype), device="cpu")
    engine = build_engine(model, num_slots=max(levels), seed=cfg.seed, max_context=cfg.serve.context,
                          expected_context=cfg.serve.context)  # fmt: skip
    served(addr, 1, 2, a.tokens)  # warm-up both ways
    direct(engine, 1, 2, a.tokens, ep.text.stop_ids)
    print(f"model {ep.model} ({a.dtype}), {a.requests} completions of {a.tokens} tokens per row, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("clients  served tok/s  direct tok/s  served/direct  latency p50/max s  same tokens")
    for c in levels:
        tps, lat, got = served(addr, c, a.requests, a.tokens)
        dps, want = direct(engine, c, a.requests, a.tokens, ep.text.stop_ids)
        same = got == want
        print(f"{c:7d}  {tps:12.0f}  {dps:12.0f}  {tps / dps:13.2f}  "
              f"{statistics.median(lat):7.2f} / {max(lat):5.2f}  {'yes' if same else 'NO'}")  # fmt: skip
    srv.shutdown()


if __name__ == "__main__":
    main()
