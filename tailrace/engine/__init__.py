"""The rollout engine: token ids in; token ids + per-token logprobs + per-token versions out."""

from tailrace.engine.engine import Engine
from tailrace.engine.errors import EngineError
from tailrace.engine.events import StepEvent

__all__ = ["Engine", "EngineError", "StepEvent"]
