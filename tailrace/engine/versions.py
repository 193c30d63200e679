"""`Versions`: the policy versions an engine holds, one `CausalLM` (+ its `Backend`) each.

Versions share nothing but the KV-cache layout. A new version is built on the meta device from the
first version's config and filled from the state dict (copied: the engine never aliases a trainer's
live tensors); loading an existing version overwrites its parameters in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tailrace.engine.backends import Backend
from tailrace.engine.errors import EngineError
from tailrace.model.decoder import CausalLM


class Versions:
    def __init__(self, model: CausalLM, make: Callable[[CausalLM], Backend]):
        """`model`: version 0; `make`: a version's backend from its model (`backends.select`)."""
        self.config = model.config
        w = model.model.embed_tokens.weight
        self.dtype, self.device = w.dtype, w.device
        self._make = make
        self._backends: dict[int, Backend] = {0: self._build(model)}

    def __contains__(self, version: int) -> bool:
        return version in self._backends

    def __getitem__(self, version: int) -> Backend:
        return self._backends[version]

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._backends))

    def load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if version in self._backends:
            backend = self._backends[version]
            self._copy_into(backend.model, state_dict)
            backend.refresh()
            return
        self._check(self._backends[min(self._backends)].model, state_dict)
        with torch.device("meta"):  # no init work; the RoPE tables are built on the CPU regardless
            model = CausalLM(self.config)
        copies = {k: t.detach().to(self.device, self.dtype, copy=True) for k, t in state_dict.items()}
        model.load_state_dict(copies, strict=False, assign=True)
        model.tie_weights()
        model.to(self.device, self.dtype)  # the RoPE buffers
        self._backends[version] = self._build(model)

    def drop(self, version: int) -> None:
        del self._backends[version]

    def relabel(self, old: int, new: int) -> None:
        """Hold `old`'s weights (as they are now) as version `new` instead."""
        self._backends[new] = self._backends.pop(old)

    def _build(self, model: CausalLM) -> Backend:
        model.eval().requires_grad_(False)
        return self._make(model)

    def _copy_into(self, model: CausalLM, state_dict: dict[str, torch.Tensor]) -> None:
        own = self._check(model, state_dict)
        with torch.no_grad():
            for k, t in own.items():
                if k in state_dict:
                    t.copy_(state_dict[k])
        model.tie_weights()

    @staticmethod
    def _check(model: CausalLM, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        own = model.state_dict()
        missing = [
            k
            for k in own
            if k not in state_dict and not (k == "lm_head.weight" and model.config.tie_word_embeddings)
        ]
        unexpected = [k for k in state_dict if k not in own]
        if missing or unexpected:
            raise EngineError(
                f"state_dict does not fit the engine's model: missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}; pass the state_dict of a model with the same config"
            )
        for k, t in own.items():
            src = state_dict.get(k)
            if src is None:
                continue
            if src.shape != t.shape:
                raise EngineError(
                    f"state_dict[{k!r}] has shape {tuple(src.shape)}, the engine's model "
                    f"{tuple(t.shape)}; pass weights of a model with the same config"
                )
        return own
