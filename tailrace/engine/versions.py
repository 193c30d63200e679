"""`Versions`: the policy versions an engine holds, one `CausalLM` (+ its `Runner`) each.

Versions share nothing but the KV-cache layout. A new version is built on the meta device from the
first version's config and filled from the state dict (copied: the engine never aliases a trainer's
live tensors); loading an existing version overwrites its parameters in place.
"""

from __future__ import annotations

import torch

from tailrace.engine.errors import EngineError
from tailrace.engine.runner import Runner
from tailrace.model.decoder import CausalLM


class Versions:
    def __init__(self, model: CausalLM, max_len: int, attention: str | None = None):
        self.config = model.config
        w = model.model.embed_tokens.weight
        self.dtype, self.device = w.dtype, w.device
        self.max_len = max_len
        self.attention = attention
        self._runners: dict[int, Runner] = {0: self._runner(model)}

    def __contains__(self, version: int) -> bool:
        return version in self._runners

    def __getitem__(self, version: int) -> Runner:
        return self._runners[version]

    def model(self, version: int) -> CausalLM:
        return self._runners[version].model

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._runners))

    def load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if version in self._runners:
            runner = self._runners[version]
            self._copy_into(runner.model, state_dict)
            runner.refresh()
            return
        self._check(self._runners[min(self._runners)].model, state_dict)
        with torch.device("meta"):  # no init work; the RoPE tables are built on the CPU regardless
            model = CausalLM(self.config)
        copies = {k: t.detach().to(self.device, self.dtype, copy=True) for k, t in state_dict.items()}
        model.load_state_dict(copies, strict=False, assign=True)
        model.tie_weights()
        model.to(self.device, self.dtype)  # the RoPE buffers
        self._runners[version] = self._runner(model)

    def drop(self, version: int) -> None:
        del self._runners[version]

    def _runner(self, model: CausalLM) -> Runner:
        model.eval().requires_grad_(False)
        return Runner(model, self.max_len, self.attention)

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
