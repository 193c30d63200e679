"""`KVCache`: per-layer key/value tensors indexed by (row, kv_head, position, head_dim).

A row holds one sequence (an engine slot). Rows are written only by a backend's forward
(`engine.backends`), which scatters each token's k/v at its absolute position (after RoPE); this class
owns storage and row moves, nothing else. Tensors start zeroed: attention masks hide unwritten positions
with a zero weight, and 0 * garbage is only safe while the garbage is finite.
"""

from __future__ import annotations

import torch

from tailrace.model.decoder import CausalLM


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        for name, v in (
            ("num_layers", num_layers),
            ("num_rows", num_rows),
            ("num_kv_heads", num_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
        ):
            if v <= 0:
                raise ValueError(f"KVCache {name}={v} must be positive")
        shape = (num_rows, num_kv_heads, max_len, head_dim)
        # Normal (not inference-mode) tensors, so the cache works inside and outside inference_mode.
        with torch.inference_mode(False):
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(
        cls,
        model: CausalLM,
        num_rows: int,
        max_len: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A zeroed cache for `model`'s layers and heads; dtype/device default to the model's."""
        w, c = model.model.embed_tokens.weight, model.config
        return cls(
            c.num_hidden_layers,
            num_rows,
            c.num_key_value_heads,
            max_len,
            c.head_dim,
            dtype or w.dtype,
            device or w.device,
        )

    @property
    def num_rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def move_row(self, src: int, dst: int, length: int | None = None) -> None:
        """Copy row `src`'s k/v into row `dst` in every layer (positions [0, length), default all);
        `src` keeps its data. Used to compact live sequences into a contiguous block of rows."""
        if src == dst:
            return
        n = self.max_len if length is None else length
        for t in self.k + self.v:
            t[dst, :, :n].copy_(t[src, :, :n])
