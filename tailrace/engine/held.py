"""The weights a `TailraceEngine` holds (a mixin of it, kept apart so the step reads on its own):
policy versions and LoRA adapters loaded, replaced and dropped, and the finished requests' kept k/v
(multi-turn continuations adopt them) forgotten when the weights they were computed with change.
"""

from __future__ import annotations

import torch

from tailrace.engine.errors import EngineError
from tailrace.engine.sequence import Sequence
from tailrace.model.lora import Adapter


class HeldWeights:
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Add weights as a new `version`, or overwrite an existing version in place (its in-flight
        requests continue from the next step with the new weights on top of their cached k/v). A
        one-version engine (`max_versions=1`) replaces the version it holds by a new one instead, only
        while no request waits or runs."""
        held = self.versions[0]
        replace = self.capabilities.versions_at_once == 1 and version != held
        if replace and self.num_running + self.num_waiting:
            raise EngineError(
                f"load_weights(version={version}): {self.num_running + self.num_waiting} request(s) of "
                f"version {held} are waiting or running, and this engine holds one version at a time "
                "(max_versions=1); let them finish or abort them first"
            )
        old = held if replace else version
        self._forget_kept(version=old)  # in place: its kept k/v are the old weights'
        with torch.inference_mode():
            self._versions.load(state_dict, old)
            if replace:
                self._versions.relabel(held, version)
                self._sorting.pop(held, None)
                if self._spec:
                    self._spec.drafter.drop(held)
            if self._spec:
                self._spec.drafter.load(version, self._versions[version].model)

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters loaded (by name)."""
        return self._adapters.names

    def load_adapter(self, name: str, adapter: Adapter) -> None:
        """Add a LoRA adapter of this engine's base model under `name` (requests name it in
        `GenRequest.adapter`), or replace the weights of the one loaded under it: its requests in
        flight continue from the next step with the new weights, as `load_weights` over a version."""
        self._forget_kept(adapter=name)
        with torch.inference_mode():
            self._adapters.load(name, adapter)

    def drop_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise EngineError(f"drop_adapter({name!r}): not loaded; loaded: {list(self.adapters)}")
        if self._per_adapter[name]:
            raise EngineError(
                f"drop_adapter({name!r}): {self._per_adapter[name]} request(s) of it are waiting or "
                "running; abort them or let them finish first"
            )
        self._forget_kept(adapter=name)
        with torch.inference_mode():  # the stacks are inference tensors: a dropped slot is zeroed in place
            self._adapters.drop(name)

    def drop_version(self, version: int) -> None:
        if version not in self._versions:
            raise EngineError(f"drop_version({version}): version not loaded; loaded: {self.versions}")
        if self._per_version[version]:
            raise EngineError(
                f"drop_version({version}): {self._per_version[version]} request(s) of it are "
                "waiting or running; abort them or let them finish first"
            )
        if len(self.versions) == 1:
            raise EngineError(f"drop_version({version}): it is the only version; load another one first")
        self._forget_kept(version=version)
        self._versions.drop(version)
        if self._spec:
            self._spec.drafter.drop(version)

    def _kept_prefix(self, seq: Sequence) -> tuple[str | None, int]:
        """Kept blocks `seq` may adopt (the longest whose tokens its own begin with) and how many of
        its positions they hold; (None, 0): none. Entries the pool took back are pruned here."""
        where = (seq.version, seq.req.adapter, seq.req.prompt_ids)
        entries = self._kept.get(where)
        if not entries:
            return None, 0
        entries[:] = [(k, t) for k, t in entries if self.paging.is_kept(k)]
        if not entries:
            del self._kept[where]
            return None, 0
        n = len(seq.ids)
        hits = [(len(t) - 1, k) for k, t in entries if len(t) <= n and seq.ids[: len(t)] == t]
        if not hits:
            return None, 0
        cached, key = max(hits)
        entries[:] = [(k, t) for k, t in entries if k != key]
        return key, cached

    def _forget_kept(self, version: int | None = None, adapter: str | None = None) -> None:
        """Kept blocks of `version` (or of `adapter`) no longer match their weights."""
        for where in [w for w in self._kept if w[0] == version or w[1] == adapter]:
            for key, _ in self._kept.pop(where):
                self.paging.forget(key)
