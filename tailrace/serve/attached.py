"""The OpenAI-compatible endpoint of a training run (flow.mode=external): an external agent drives the
run's own rollout engines and sends its scored completions back as groups, which the run trains.

The HTTP handler threads (server.py, as `tailrace serve`'s) talk to the driver through `RunLoop`: a
request, a cancellation or a group goes into its inbox; the driver's loop hands them to the scheduler
between polls (`intake`) and gives each finished completion back to the handler waiting on it
(`answer`). The scheduler decides the rest (flow/external.py): the engine, the version (the newest an
engine holds), a requeue if its engine is lost. The driver writes `RUN/endpoint.json` (the URL and the
model's name; never the token) so an agent finds the run.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
from pathlib import Path

from tailrace.flow.external import ExternalError
from tailrace.serve.server import Endpoint, make_server
from tailrace.types import GenRequest, SamplingParams

PREFIX = "x.cmpl-"  # the scheduler's external ids start "x."
ENDED = "the training run has ended (it trained all its steps): it takes no more requests or groups"


class RunLoop:
    """The handlers' side: thread-safe (an inbox); the driver's side: `intake` and `answer`, called by
    its own thread only."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, queue.SimpleQueue] = {}  # request id -> its handler's events (driver's)
        self.lock = threading.Lock()
        self.closed = False  # the run ended: whatever comes is answered at once

    def _put(self, msg: tuple, reply: queue.SimpleQueue) -> queue.SimpleQueue:
        with self.lock:
            if not self.closed:
                self.inbox.put(msg)
                return reply
        reply.put(("error", ENDED))
        return reply

    # -- the handlers' side -------------------------------------------------------------------
    def submit(self, reqs: list[GenRequest], stream: bool) -> queue.SimpleQueue:
        """Events come as `EngineLoop.submit`'s: ("done", GenResult) per request, or ("error", message).
        A stream gets each whole completion as one chunk (the run's engines report finished requests)."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        return self._put(("add", reqs, events), events)

    def cancel(self, request_ids: list[str]) -> None:
        self._put(("cancel", request_ids), queue.SimpleQueue())

    def version(self) -> int:
        return 0  # set at dispatch: the newest version an engine holds

    def group(self, ids: list[str], rewards: list, correct: list | None) -> queue.SimpleQueue:
        """("ok", group id) or ("error", message)."""
        reply: queue.SimpleQueue = queue.SimpleQueue()
        return self._put(("group", ids, rewards, correct, reply), reply)

    # -- the driver's side ----------------------------------------------------------------------
    def intake(self, sched) -> bool:
        """Hand what came in to the scheduler (`sched`: the run's one policy). True if anything came."""
        came = False
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return came
            came = True
            if msg[0] == "add":
                _, reqs, events = msg
                try:
                    for r in reqs:
                        sched.submit_external(r)
                except ExternalError as e:
                    sched.cancel_external([r.id for r in reqs])
                    events.put(("error", str(e)))
                    continue
                self.sinks.update((r.id, events) for r in reqs)
            elif msg[0] == "cancel":
                sched.cancel_external(msg[1])
                for rid in msg[1]:
                    self.sinks.pop(rid, None)
            else:
                _, ids, rewards, correct, reply = msg
                try:
                    reply.put(("ok", sched.submit_group(ids, rewards, correct)))
                except ExternalError as e:
                    reply.put(("error", str(e)))

    def answer(self, sched) -> None:
        for r in sched.take_external():
            sink = self.sinks.pop(r.request_id, None)
            if sink is not None:
                sink.put(("done", r))

    def close(self) -> None:
        """The run ended: requests and groups still waiting get an error, not silence."""
        with self.lock:
            self.closed = True
        waiting = list(self.sinks.values())
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if msg[0] != "cancel":
                waiting.append(msg[-1])
        for events in {id(e): e for e in waiting}.values():
            events.put(("error", ENDED))
        self.sinks.clear()


class Attached:
    """A running endpoint of a training run: its server thread, its loop, where it listens."""

    def __init__(self, cfg, text, model_name: str, context: int, sampling: SamplingParams, run_path: Path):
        s = cfg.serve
        self.loop = RunLoop()
        self.token = s.token or secrets.token_urlsafe(24)
        ep = Endpoint(self.loop, text, model_name, self.token, cfg.rollout.max_new_tokens,
                      text.model_cfg.vocab_size, context, sampling=sampling, prefix=PREFIX, bos=True)  # fmt: skip
        self.server = make_server(ep, s.host, s.port)
        host, port = self.server.server_address[:2]
        self.url = f"http://{host}:{port}/v1"
        self.file = run_path / "endpoint.json"
        self.file.write_text(
            json.dumps({"url": self.url, "model": model_name, "groups": f"{self.url}/groups"})
        )
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="endpoint", daemon=True)  # fmt: skip
        self.thread.start()
        self.generated_token = s.token is None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.loop.close()
        self.file.unlink(missing_ok=True)
