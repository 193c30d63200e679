"""`KVCache`: the paged key/value cache -- per layer k, v (num_blocks, kv_head, block_size, head_dim) --
and the `BlockTable` saying which blocks hold each cache row's positions.

A row holds one sequence (an engine slot); its positions live in fixed-size blocks of a shared pool,
handed out as it grows (`Paging` decides, the engine writes the table), so memory follows the tokens
actually held, not slots x context. Blocks are written only by a backend's forward
(`engine.backends`), which puts each token's k/v (after RoPE) at its position; this class owns storage
and the table, nothing else. Storage starts zeroed: the torch backend reads whole blocks and masks the
positions past a row's length with a zero weight, and 0 * garbage is only safe while the garbage is
finite (a block that held another sequence's k/v is).
"""

from __future__ import annotations

import torch

from tailrace.engine.block_table import BlockTable
from tailrace.model.decoder import CausalLM
from tailrace.model.moe import sparse_layers


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        num_rows: int,
        max_context: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        """`num_rows` rows of up to `max_context` positions each, over a pool of `num_blocks` blocks."""
        for name, v in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("num_kv_heads", num_kv_heads),
            ("block_size", block_size),
            ("head_dim", head_dim),
            ("num_rows", num_rows),
            ("max_context", max_context),
        ):
            if v <= 0:
                raise ValueError(f"KVCache {name}={v} must be positive")
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        # Normal (not inference-mode) tensors, so the cache works inside and outside inference_mode.
        with torch.inference_mode(False):
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # routing replay (`keep_routes`): per block position, the experts its token's forward chose
        self.routes: torch.Tensor | None = None
        self.table = BlockTable(num_rows, -(-max_context // block_size), device)

    @classmethod
    def for_model(
        cls,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        num_rows: int,
        max_context: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A zeroed cache for `model`'s layers and heads; dtype/device default to the model's."""
        w, c = model.model.embed_tokens.weight, model.config
        return cls(
            c.num_hidden_layers,
            num_blocks,
            c.num_key_value_heads,
            block_size,
            c.head_dim,
            num_rows,
            max_context,
            dtype or w.dtype,
            device or w.device,
        )

    def sibling(self, num_layers: int) -> KVCache:
        """A zeroed pool of the same blocks for a model of `num_layers` layers with these heads (a
        drafter's own cache): it reads this cache's block table, so its rows hold their positions in the
        same blocks, handed out and moved with this cache's."""
        k = self.k[0]
        c = KVCache(num_layers, k.shape[0], k.shape[1], k.shape[2], k.shape[3], 1, 1, k.dtype, k.device)
        c.table = self.table
        return c

    def keep_routes(self, sparse_layers: int, k: int) -> None:
        """Keep, beside each position's k/v, the k experts (< 256) each of `sparse_layers` mixture-of-experts
        layers chose for its token (the backends write them; model/moe.py)."""
        with torch.inference_mode(False):
            self.routes = torch.zeros(
                (self.num_blocks * self.block_size, sparse_layers, k), dtype=torch.uint8, device=self.device
            )

    def places(self, rows: torch.Tensor | int, positions: torch.Tensor) -> torch.Tensor:
        """Where in the pool's block positions (block x block_size + offset) each of `rows`' `positions`
        lies: a token's routes' index (its k/v's, per head, in the backends)."""
        bs = self.block_size
        return self.table.t[rows, positions // bs].long() * bs + positions % bs

    def read_routes(self, row: int, n: int) -> bytes:
        """The routes of row `row`'s positions [0, n), as `GenResult.routes` holds them."""
        at = self.places(row, torch.arange(n, device=self.device))
        return self.routes.index_select(0, at).cpu().numpy().tobytes()

    @staticmethod
    def token_bytes(model: CausalLM, dtype: torch.dtype, routes: bool = False) -> int:
        """Bytes of one token's k and v in every layer of `model`, stored in `dtype` (and its routes: a
        byte per expert chosen in each sparse layer)."""
        c = model.config
        kept = sparse_layers(c) * c.num_experts_per_tok if routes else 0
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * dtype.itemsize + kept

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def max_context(self) -> int:
        """Positions a row can address (the table's width in blocks x block_size)."""
        return self.table.width * self.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def nbytes(self) -> int:
        routes = [] if self.routes is None else [self.routes]
        return sum(t.numel() * t.element_size() for t in self.k + self.v + routes)
