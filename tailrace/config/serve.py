"""The serve section: `tailrace serve`, an OpenAI-compatible endpoint on a rollout engine, and the same
endpoint on a training run's engines for an external agent (flow.mode=external: serve/attached.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.config.fields import need, setting


@dataclass
class ServeConfig:
    host: str = setting(
        "127.0.0.1", "address to listen on (loopback: this machine only; 0.0.0.0 exposes it, token or not)"
    )
    port: int = setting(8000, "TCP port (0: any free one, printed at start)")
    token: str | None = setting(
        None, "the bearer token every request must carry (null: a fresh random one, printed at start)"
    )
    slots: int = setting(16, "concurrent sequences the engine batches")
    context: int = setting(2048, "tokens a request may hold, prompt and response (longer ones are refused)")
    max_tokens: int = setting(256, "response tokens when a request names no max_tokens")

    def __post_init__(self) -> None:
        need(0 <= self.port <= 65535, f"serve.port={self.port}: must be a TCP port in [0, 65535]")
        need(self.token is None or len(self.token) >= 8, "serve.token: use at least 8 characters, or null")
        for k in ("slots", "context", "max_tokens"):
            need(getattr(self, k) > 0, f"serve.{k}={getattr(self, k)}: must be positive")
