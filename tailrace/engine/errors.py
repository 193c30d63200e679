"""`EngineError`: a bad request or call, reported in one line that names the problem and the fix.

Raised before any state changes, so the other requests in the engine are never disturbed."""
from __future__ import annotations


class EngineError(ValueError):
    pass
