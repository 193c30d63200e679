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
import os
import queue
import secrets
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tailrace.flow.external import DONE, ExternalError
from tailrace.serve.server import LOOPBACK, Endpoint, make_server
from tailrace.types import GenRequest, SamplingParams

PREFIX = "x.cmpl-"  # the scheduler's external ids start "x."
ENDED = "the training run has ended (it trained all its steps): it takes no more requests or groups"


class RunLoop:
    """The handlers' side: thread-safe (an inbox); the driver's side: `intake` and `answer`, called by
    its own thread only. `models`: the run's policies by name; a request's `model` names the policy
    that generates it (and trains its group), which a run of one policy does not need."""

    def __init__(self, models: Sequence[str] = ("main",)) -> None:
        self.models = list(models)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> its handler's events and its policy (the driver's side)
        self.sinks: dict[str, tuple[queue.SimpleQueue, int]] = {}
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
    def submit(self, reqs: list[GenRequest], stream: bool, model: str | None = None) -> queue.SimpleQueue:
        """Events come as `EngineLoop.submit`'s: ("done", GenResult) per request, or ("error", message).
        A stream gets each whole completion as one chunk (the run's engines report finished requests)."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        p = self._policy(model, events)
        return events if p is None else self._put(("add", p, reqs, events), events)

    def _policy(self, model: str | None, reply: queue.SimpleQueue) -> int | None:
        """The policy `model` names (a run of one: its only one, whatever the name); None, with an
        error on `reply`, when it names none."""
        if len(self.models) == 1:
            return 0
        if model in self.models:
            return self.models.index(model)
        reply.put(("error", f"model={model!r}: name one of this run's policies: {', '.join(self.models)}"))
        return None

    def cancel(self, request_ids: list[str]) -> None:
        self._put(("cancel", request_ids), queue.SimpleQueue())

    def version(self) -> int:
        return 0  # set at dispatch: the newest version an engine holds

    def group(self, ids: list[str], rewards: list, correct: list | None, model=None) -> queue.SimpleQueue:
        """("ok", group id) or ("error", message)."""
        reply: queue.SimpleQueue = queue.SimpleQueue()
        p = self._policy(model, reply)
        return reply if p is None else self._put(("group", p, ids, rewards, correct, reply), reply)

    # -- the driver's side ----------------------------------------------------------------------
    def intake(self, policies) -> None:
        """Hand what came in to the policies' schedulers (`policies`: the run's `PolicySet`, or a list of
        schedulers)."""
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, p, reqs, events = msg
                sched = policies[p]
                try:
                    for r in reqs:
                        sched.submit_external(r)
                except ExternalError as e:
                    sched.cancel_external([r.id for r in reqs])
                    events.put(("error", str(e)))
                    continue
                self.sinks.update((r.id, (events, p)) for r in reqs)
            elif msg[0] == "cancel":
                for sched in policies:  # (ids are unique across policies: one counter)
                    sched.cancel_external(msg[1])
                for rid in msg[1]:
                    self.sinks.pop(rid, None)
            else:
                _, p, ids, rewards, correct, reply = msg
                try:
                    reply.put(("ok", policies[p].submit_group(ids, rewards, correct)))
                except ExternalError as e:
                    reply.put(("error", str(e)))

    def answer(self, policies) -> None:
        """Finished requests to their handlers; those of a policy that has trained all its steps (in a
        run of several, the others go on) get its refusal instead of waiting for ever."""
        for sched in policies:
            for r in sched.take_external():
                sink = self.sinks.pop(r.request_id, None)
                if sink is not None:
                    sink[0].put(("done", r))
        for rid in [rid for rid, (_, p) in self.sinks.items() if policies[p].done]:
            self.sinks.pop(rid)[0].put(("error", DONE))

    def close(self) -> None:
        """The run ended: requests and groups still waiting get an error, not silence."""
        with self.lock:
            self.closed = True
        waiting = [events for events, _ in self.sinks.values()]
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

    def __init__(
        self, cfg, text, model_name: str, context: int, sampling: SamplingParams, run_path: Path,
        policies: Sequence[str] = ("main",), texts: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        s = cfg.serve
        self.loop = RunLoop(policies)
        self.token = s.token or secrets.token_urlsafe(24)
        ep = Endpoint(self.loop, text, model_name, self.token, cfg.rollout.max_new_tokens,
                      text.model_cfg.vocab_size, context, sampling=sampling, prefix=PREFIX, bos=True,
                      texts=texts)  # fmt: skip
        self.ep, self.server = ep, make_server(ep, s.host, s.port)
        host, port = self.server.server_address[:2]
        self.url, self.model_name = f"http://{host}:{port}/v1", model_name
        self.file = run_path / "endpoint.json"
        self._describe()
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="endpoint", daemon=True)  # fmt: skip
        self.thread.start()
        self.generated_token = s.token is None
        self.exposed = s.host not in LOOPBACK  # reachable from other machines

    def _describe(self) -> None:
        about = {"url": self.url, "model": self.model_name, "groups": f"{self.url}/groups",
                 "policies": list(self.loop.models)}  # fmt: skip
        tmp = self.file.with_name(self.file.name + ".tmp")  # whole or not at all, for an agent polling it
        tmp.write_text(json.dumps(about))
        os.replace(tmp, self.file)

    def add_policy(self, name: str, text: Any) -> None:
        """A policy joined the run (tailrace policy join): requests may name it, and its text side
        (chat template, system prompt) renders theirs."""
        self.ep.texts = {**self.ep.texts, name: text}  # (a new dict: handler threads read the old one)
        self.loop.models = [*self.loop.models, name]
        self._describe()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.loop.close()
        self.file.unlink(missing_ok=True)
