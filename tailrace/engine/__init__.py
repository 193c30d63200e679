"""The rollout engine: token ids in; token ids + per-token logprobs + per-token versions out.

Callers type against the `Engine` protocol and get an engine from `build_engine`.
"""

from typing import Any

from tailrace.engine.engine import TailraceEngine
from tailrace.engine.errors import EngineError
from tailrace.engine.events import StepEvent
from tailrace.engine.protocol import Capabilities, Engine
from tailrace.model.decoder import CausalLM


def build_engine(model: CausalLM, **options: Any) -> Engine:
    """An engine serving `model` as version 0: tailrace's own, `TailraceEngine(model, **options)` (see
    its constructor for the options). An adapter to another engine will be chosen here."""
    return TailraceEngine(model, **options)


__all__ = ["Capabilities", "Engine", "EngineError", "StepEvent", "TailraceEngine", "build_engine"]
