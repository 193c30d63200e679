"""`tailrace serve`: an OpenAI-compatible HTTP endpoint on one rollout engine.

One thread owns the engine (the protocol's calls come from the thread that steps): it takes new
requests and cancellations from a queue between steps, steps while anything runs, and hands each
request's events to the handler thread waiting on it -- the partial after every step the request
advanced in (streaming only, `Engine.peek`) and the finished result. Requests of all connections
are batched together by the engine's continuous batching. A client that goes away mid-stream has
its requests aborted. Every request needs `Authorization: Bearer <token>`; the server listens on
loopback unless told otherwise.
"""

from __future__ import annotations

import copy
import hmac
import itertools
import json
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tailrace.engine import Engine, EngineError
from tailrace.serve import api
from tailrace.types import Finish, GenRequest, GenResult, SamplingParams

ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}
GROUPS = "/v1/groups"  # a training run's (flow.mode=external): scored completions sent back as a group
MAX_BODY = 8 << 20  # bytes of a request body
LOOPBACK = ("127.0.0.1", "::1", "localhost")  # a host only this machine reaches


class EngineLoop(threading.Thread):
    def __init__(self, engine: Engine) -> None:
        super().__init__(name="engine", daemon=True)
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, tuple[queue.SimpleQueue, bool]] = {}  # request id -> (events, streamed)

    def submit(self, reqs: list[GenRequest], stream: bool, model: str | None = None) -> queue.SimpleQueue:
        """Queue `reqs`; their events come on the returned queue: ("partial" | "done", GenResult), or
        ("error", message) when the engine refuses one (then none of them runs). `model`: ignored
        (one model is served)."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        self.inbox.put(("add", reqs, events, stream))
        return events

    def cancel(self, request_ids: list[str]) -> None:
        self.inbox.put(("cancel", request_ids))

    def version(self) -> int:
        """The version a new request is generated under: the newest the engine holds."""
        return max(self.engine.versions)

    def group(self, ids: list[str], rewards: list, correct: list | None, model=None) -> queue.SimpleQueue:
        """Only a training run takes groups (serve/attached.py)."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        events.put(("refused", f"POST {GROUPS} sends groups to a training run (tailrace train --flow.mode=external); "
                               "`tailrace serve` trains nothing"))  # fmt: skip
        return events

    def stop(self) -> None:
        self.inbox.put(("stop",))
        self.join(timeout=10)

    def run(self) -> None:
        e = self.engine
        while True:
            idle = e.num_running + e.num_waiting == 0
            msgs = [self.inbox.get()] if idle else []  # idle: sleep until a request comes
            while True:
                try:
                    msgs.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for msg in msgs:
                if msg[0] == "stop":
                    return
                self._apply(msg)
            if e.num_running + e.num_waiting == 0:
                continue
            ev = e.step()
            done = {r.request_id for r in ev.finished}
            for rid in dict.fromkeys(ev.advanced):
                sink = self.sinks.get(rid)
                if sink is not None and sink[1] and rid not in done:
                    sink[0].put(("partial", e.peek(rid)))
            for r in ev.finished:
                sink = self.sinks.pop(r.request_id, None)
                if sink is not None:
                    sink[0].put(("done", r))

    def _apply(self, msg: tuple) -> None:
        if msg[0] == "add":
            _, reqs, events, stream = msg
            added = []
            try:
                for r in reqs:
                    self.engine.add(r)
                    added.append(r.id)
            except EngineError as err:
                for rid in added:
                    self.engine.abort(rid)
                events.put(("error", str(err)))
                return
            for rid in added:
                self.sinks[rid] = (events, stream)
        elif msg[0] == "cancel":
            for rid in msg[1]:
                if rid in self.engine:
                    self.engine.abort(rid)
                self.sinks.pop(rid, None)


class Endpoint:
    """What the handlers share: the engine loop (an `EngineLoop`, or a training run's
    `serve.attached.RunLoop`), the model's text side, the token, the defaults. `sampling`: a training
    run's sampling (temperature, top-p, top-k: what its trainer's ratios assume), every request's
    default and the only values taken; None: any. `prefix`: of the response ids. `bos`: a completion's
    text prompt starts with BOS (a training run's: as it encodes its own prompts; `tailrace serve`:
    the text's tokens alone). `texts`: a run's policies' text sides by name (`of`)."""

    def __init__(
        self, loop: Any, text: Any, model: str, token: str, max_tokens: int, vocab: int, context: int,
        sampling: SamplingParams | None = None, prefix: str = "cmpl-", bos: bool = False,
        texts: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.loop, self.text, self.model, self.token = loop, text, model, token
        self.texts = texts or {}
        self.max_tokens, self.vocab, self.context = max_tokens, vocab, context
        self.sampling, self.prefix, self.bos = sampling, prefix, bos
        self.ids = itertools.count()
        self.lock = threading.Lock()

    def of(self, model: str | None) -> Endpoint:
        """What serves a request naming `model`: in a run of several policies, that policy's text side
        (its chat template and system prompt); the rest shared (ids, lock, loop)."""
        text = self.texts.get(model) if model is not None else None
        if text is None or text is self.text:
            return self
        ep = copy.copy(self)
        ep.text = text
        return ep

    def next_id(self) -> str:
        with self.lock:
            return f"{self.prefix}{next(self.ids)}"

    def encode(self, prompt: str) -> list[int]:
        return self.text.tok.encode(prompt, bos=self.bos)

    def render(self):
        """messages (and a request's thinking switch, None: the run's) -> token ids; None: no template."""
        chat = self.text.chat
        if chat is None:
            return None

        def render(turns: list[dict], thinking: bool | None) -> list[int]:
            if thinking is not None and not chat.switch:
                raise api.ApiError(
                    "chat_template_kwargs: this model's chat template has no enable_thinking switch; drop it",
                    param="chat_template_kwargs",
                )
            return self.text.tok.encode(chat.render_turns(turns, thinking))

        return render


def make_server(endpoint: Endpoint, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(_Handler):
        ep = endpoint

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


class _Handler(BaseHTTPRequestHandler):
    ep: Endpoint
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 — the base class's name
        pass  # one line per request is noise; errors go back to the client

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path != "/v1/models":
            return self._error(api.ApiError(f"no route {self.path}; GET /v1/models", status=404))
        self._json(
            200,
            {
                "object": "list",
                "data": [
                    {"id": m, "object": "model", "owned_by": "tailrace"}
                    for m in getattr(self.ep.loop, "models", None) or [self.ep.model]
                ],
            },  # fmt: skip
        )

    def do_POST(self) -> None:
        if not self._authorized():
            return
        if self.path not in ROUTES and self.path != GROUPS:
            routes = " or ".join([*ROUTES, GROUPS])
            return self._error(api.ApiError(f"no route {self.path}; POST {routes}", status=404))
        try:
            size = int(self.headers.get("Content-Length", "0"))
            if not 0 < size <= MAX_BODY:
                raise api.ApiError(
                    f"the body must be JSON of 1 byte to {MAX_BODY >> 20} MiB (Content-Length)"
                )
            try:
                body = json.loads(self.rfile.read(size))
            except (ValueError, UnicodeDecodeError):
                raise api.ApiError("the body is not valid JSON") from None
            model = body.get("model") if isinstance(body, dict) else None  # a training run's: its policy
            self.ep = type(self).ep.of(model if isinstance(model, str) else None)  # (this request's)
            if self.path == GROUPS:
                return self._group(api.parse_group(body), model)
            ep = self.ep
            p = api.parse(body, ROUTES[self.path], ep.encode, ep.render(), ep.text.stop_ids,
                          ep.max_tokens, ep.vocab, ep.context, ep.sampling)  # fmt: skip
        except api.ApiError as e:
            return self._error(e)
        rid, created = self.ep.next_id(), int(time.time())
        version = self.ep.loop.version()
        reqs = [GenRequest(f"{rid}-{i}", p.prompt_ids, sp, version) for i, sp in enumerate(p.params)]
        events = self.ep.loop.submit(reqs, p.stream, model)
        if p.stream:
            self._stream(rid, created, p, reqs, events)
        else:
            self._whole(rid, created, p, reqs, events)

    def _group(self, g: tuple[list[str], list, list | None], model: str | None) -> None:
        kind, x = self.ep.loop.group(*g, model).get()
        if kind == "ok":
            return self._json(200, {"object": "group", "group": x, "completions": len(g[0])})
        self._error(api.ApiError(x, status=404 if kind == "refused" else 409))

    # ------------------------------------------------------------------ responses
    def _whole(self, rid: str, created: int, p: api.Parsed, reqs: list[GenRequest], events) -> None:
        results: dict[str, GenResult] = {}
        while len(results) < len(reqs):
            kind, x = events.get()
            if kind == "error":
                return self._error(api.ApiError(x))
            if kind == "done":
                results[x.request_id] = x
        ordered = [results[r.id] for r in reqs]
        self._json(200, api.response(rid, self.ep.model, created, p, ordered, self.ep.text.response_text))

    def _stream(self, rid: str, created: int, p: api.Parsed, reqs: list[GenRequest], events) -> None:
        index = {r.id: i for i, r in enumerate(reqs)}
        sent = {r.id: 0 for r in reqs}  # tokens already sent per choice
        deltas = {r.id: api.Delta(self._decode) for r in reqs}
        left = set(index)
        first = events.get()
        if first[0] == "error":
            return self._error(api.ApiError(first[1]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        kind, r = first
        try:
            while True:
                final = kind == "done"
                new = replace(r, token_ids=r.token_ids[sent[r.request_id] :], logprobs=r.logprobs[sent[r.request_id] :],
                              versions=r.versions[sent[r.request_id] :])  # fmt: skip
                sent[r.request_id] = len(r.token_ids)
                text = deltas[r.request_id](self._visible(r), final)
                if new.token_ids or final:
                    c = api.chunk(rid, self.ep.model, created, p, index[r.request_id], text, new,
                                  r.finish if final else None)  # fmt: skip
                    self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
                    self.wfile.flush()
                if final:
                    left.discard(r.request_id)
                    if not left:
                        break
                kind, r = events.get()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client left: its requests stop
            self.ep.loop.cancel(sorted(left))

    def _visible(self, r: GenResult) -> list[int]:
        stop = self.ep.text.stop_ids
        ids = list(r.token_ids)
        return ids[:-1] if r.finish == Finish.STOP and ids and ids[-1] in stop else ids

    def _decode(self, ids: list[int]) -> str:
        return self.ep.text.tok.decode(ids)

    def _authorized(self) -> bool:
        got = self.headers.get("Authorization", "")
        if hmac.compare_digest(got.encode(), f"Bearer {self.ep.token}".encode()):
            return True
        self._error(api.ApiError("missing or wrong token: send Authorization: Bearer <token>", status=401))
        return False

    def _error(self, e: api.ApiError) -> None:
        self._json(e.status, e.body())

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
