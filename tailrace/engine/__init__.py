"""The rollout engine: token ids in; token ids + per-token logprobs + per-token versions out.

Callers type against the `Engine` protocol and get an engine from `build_engine`, which picks the
implementation (`BACKENDS`): tailrace's own, or the adapter to vLLM.
"""

from pathlib import Path
from typing import Any

from tailrace.engine import engine as tailrace_engine
from tailrace.engine import vllm_engine
from tailrace.engine.engine import TailraceEngine
from tailrace.engine.errors import EngineError
from tailrace.engine.events import StepEvent
from tailrace.engine.protocol import Engine
from tailrace.model.decoder import CausalLM
from tailrace.types import Capabilities

BACKENDS = ("tailrace", "vllm")


def build_engine(model: CausalLM | str | Path, backend: str = "tailrace", **options: Any) -> Engine:
    """An engine serving `model` as version 0. backend "tailrace": `TailraceEngine(model, **options)`,
    `model` a `CausalLM`; "vllm": `VLLMEngine(model, **options)`, `model` a checkpoint directory (see
    each constructor for its options)."""
    if backend == "tailrace":
        if not isinstance(model, CausalLM):
            raise EngineError(
                f"backend=tailrace serves a CausalLM, got {type(model).__name__}; load_pretrained it"
            )
        return TailraceEngine(model, **options)
    if backend == "vllm":
        if not isinstance(model, (str, Path)):
            raise EngineError(
                f"backend=vllm loads a checkpoint directory, got {type(model).__name__}; pass its path"
            )
        return vllm_engine.VLLMEngine(str(model), **options)
    raise EngineError(f"backend={backend!r} is unknown; use one of {', '.join(BACKENDS)}")


def capabilities(backend: str, speculative: bool = False, max_versions: int | None = None) -> Capabilities:
    """What an engine of `backend` can do, known before one is built (the scheduler is built first).
    `max_versions`: tailrace's engine's option (vLLM holds one version regardless)."""
    if backend == "vllm":
        return vllm_engine.CAPABILITIES
    return tailrace_engine.capabilities(speculative, max_versions)


__all__ = [
    "BACKENDS",
    "Capabilities",
    "Engine",
    "EngineError",
    "StepEvent",
    "TailraceEngine",
    "build_engine",
    "capabilities",
]
