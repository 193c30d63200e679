"""`AdapterVersions`: an engine whose weight versions are LoRA adapters over one frozen base.

A LoRA run's trainer publishes its adapter alone (`train.lora`): the policy's version v is the base
plus adapter v. This presents the `Engine` protocol over an engine that serves adapters
(`capabilities.adapters`) with versions that are adapters:

  * `load_weights(state, v)` takes an adapter's parameters as the trainer's model names them
    (`model.layers.0.self_attn.q_proj.lora_A.weight`, ... `lora_B.weight`) and loads them as the
    adapter "v<v>" (over it in place when v is held, as a version is);
  * a request of version v runs on the base (the inner engine's only version) with that adapter, so
    the rows of every version share one forward, the base GEMMs run once; its result carries v again
    for the tokens generated here (those it resumed keep theirs);
  * version 0 before any load is the base itself: a fresh adapter's B is zero, so it adds exact zeros.

Holding another version costs an adapter's memory (a few MB), not a model's: `versions_at_once` is
unbounded whatever the inner engine's. Speculative decoding stays exact (verification runs each row
through its adapter), and its figures per version come from the inner engine's per adapter (a row of
adapter "v<v>" is version v's; a row of none, version 0's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from tailrace.common import InputError
from tailrace.engine.errors import EngineError
from tailrace.engine.events import StepEvent
from tailrace.engine.protocol import Engine
from tailrace.model import lora
from tailrace.model.lora import Adapter
from tailrace.types import GenRequest, GenResult


def adapter_from_state(state: dict[str, torch.Tensor], alpha: float) -> Adapter:
    """The adapter whose parameters `state` holds, keyed as `lora.attach` names them in the model."""
    a = next((t for k, t in state.items() if ".lora_A." in k), None)
    try:
        return lora.from_state(state, a.shape[0] if a is not None else 0, alpha, "load_weights")
    except InputError as e:
        raise EngineError(f"{e}; a LoRA run's engines load the adapter's parameters alone") from None


class AdapterVersions:
    def __init__(self, engine: Engine, alpha: float):
        """`engine`: holding the base as its one version; `alpha`: the adapters' LoRA alpha."""
        if not engine.capabilities.adapters:
            raise EngineError("versions as adapters need an engine that serves LoRA adapters")
        self.inner, self.alpha = engine, alpha
        self._base = engine.versions[0]
        self._held: dict[int, str] = {0: ""}  # version -> its adapter's name ("": the base itself)
        self._live: dict[str, tuple[int, int]] = {}  # request id -> (version, tokens it resumed)
        self.capabilities = dataclasses.replace(engine.capabilities, versions_at_once=None)

    def __getattr__(self, name: str):  # describe, num_running, idle, add_history, spec_stats, ...
        return getattr(self.inner, name)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.inner

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(sorted(self._held))

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        name = f"v{version}"
        self.inner.load_adapter(name, adapter_from_state(state_dict, self.alpha))
        self._held[version] = name

    def load_adapter_version(self, adapter: Adapter, version: int) -> None:
        """Version `version` from an adapter already built (a checkpoint's PEFT files)."""
        self.inner.load_adapter(f"v{version}", adapter)
        self._held[version] = f"v{version}"

    def drop_version(self, version: int) -> None:
        if version not in self._held:
            raise EngineError(f"drop_version({version}): version not loaded; loaded: {self.versions}")
        if any(v == version for v, _ in self._live.values()):
            raise EngineError(f"drop_version({version}): request(s) of it are waiting or running")
        name = self._held.pop(version)
        if name:
            self.inner.drop_adapter(name)

    def add(self, req: GenRequest) -> None:
        if req.version not in self._held:
            raise EngineError(
                f"request {req.id!r}: version {req.version} not loaded; loaded: {self.versions}"
            )
        if req.adapter:
            raise EngineError(
                f"request {req.id!r}: names adapter {req.adapter!r}; its version is its adapter"
            )
        self.inner.add(dataclasses.replace(req, version=self._base, adapter=self._held[req.version]))
        self._live[req.id] = (req.version, len(req.resume_versions))

    def _own(self, r: GenResult, done: bool = True) -> GenResult:
        version, resumed = self._live.pop(r.request_id) if done else self._live[r.request_id]
        ours = r.versions[:resumed] + (version,) * (len(r.versions) - resumed)
        return dataclasses.replace(r, versions=ours)

    def step(self) -> StepEvent:
        ev = self.inner.step()
        if not ev.finished and not ev.by_version:
            return ev
        # rows of adapter "v<v>" are version v's, the rest the base's (version 0)
        named_d, named_a = sum(d for _, d, _ in ev.by_adapter), sum(a for _, _, a in ev.by_adapter)
        by = {0: [ev.drafted - named_d, ev.accepted - named_a]}
        for name, d, a in ev.by_adapter:
            by[int(name[1:])] = [d, a]
        by_version = tuple((v, d, a) for v, (d, a) in sorted(by.items()) if d)
        return dataclasses.replace(ev, finished=tuple(map(self._own, ev.finished)), by_version=by_version)

    def abort(self, request_id: str) -> GenResult:
        return self._own(self.inner.abort(request_id))

    def peek(self, request_id: str) -> GenResult:
        return self._own(self.inner.peek(request_id), done=False)

    def generate(
        self, requests: list[GenRequest], on_done: Callable[[int, int], None] | None = None
    ) -> list[GenResult]:
        for r in requests:
            self.add(r)
        out: dict[str, GenResult] = {}
        while len(out) < len(requests):
            for r in self.step().finished:
                out[r.request_id] = r
                if on_done is not None:
                    on_done(len(out), len(requests))
        return [out[r.id] for r in requests]
