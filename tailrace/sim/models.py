"""`ModelShape`: what the cost model needs to know about a decoder — parameter counts, the bytes a
decode step reads, the FLOPs a token costs — and presets for the models in the published setups.

Shapes come from each model's Hugging Face config.json (cited per preset); parameter counts are
computed from the shape, not copied, so a preset and its count cannot disagree. Dense Llama/Qwen
layout: attention q/k/v/o (+ q/k/v bias in Qwen2), SwiGLU MLP (3 matrices), RMSNorms, embeddings
(tied or not). MoE (Qwen3-MoE layout): every layer's MLP is `experts` SwiGLU experts of width
`expert_intermediate`, `experts_per_token` of them active per token, plus a router; Qwen2-MoE's also a
shared expert every token goes through (`shared_intermediate` wide, with a one-output gate).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (unused when experts > 0)
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    experts: int = 0  # 0 = dense
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (0: none)

    def __post_init__(self) -> None:
        if self.experts and not (0 < self.experts_per_token <= self.experts and self.expert_intermediate > 0):
            raise ValueError(
                f"model {self.name}: an MoE needs 0 < experts_per_token <= experts and expert_intermediate > 0"
            )

    # -- parameter counts ------------------------------------------------------------------------
    @cached_property
    def attn_params(self) -> int:
        """One layer's attention: q and o are heads*head_dim wide, k and v kv_heads*head_dim."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return self.hidden * q * 2 + self.hidden * kv * 2 + bias

    @cached_property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    @cached_property
    def always_params(self) -> int:
        """What of an MoE layer's MLP every token reads: the router, and a shared expert and its gate."""
        shared = 3 * self.hidden * self.shared_intermediate + self.hidden if self.shared_intermediate else 0
        return self.hidden * self.experts + shared

    @cached_property
    def mlp_params(self) -> int:
        """One layer's MLP, all experts (what sits in memory)."""
        if self.experts:
            return self.experts * self.expert_params + self.always_params
        return 3 * self.hidden * self.intermediate

    @cached_property
    def active_mlp_params(self) -> int:
        """One layer's MLP as one token sees it (the active experts)."""
        if self.experts:
            return self.experts_per_token * self.expert_params + self.always_params
        return self.mlp_params

    @cached_property
    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @cached_property
    def params(self) -> int:
        norms = self.layers * 2 * self.hidden + self.hidden
        return self.layers * (self.attn_params + self.mlp_params) + self.embed_params + norms

    @cached_property
    def active_params(self) -> int:
        norms = self.layers * 2 * self.hidden + self.hidden
        return self.layers * (self.attn_params + self.active_mlp_params) + self.embed_params + norms

    @cached_property
    def matmul_params(self) -> int:
        """Parameters a token multiplies through (active, without the input embedding lookup)."""
        return self.layers * (self.attn_params + self.active_mlp_params) + self.vocab * self.hidden

    # -- per-token costs ---------------------------------------------------------------------------
    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token, all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    @cached_property
    def attn_flops_per_context_token(self) -> int:
        """Forward FLOPs one query token spends per context token: QK^T and AV, all layers."""
        return 4 * self.layers * self.heads * self.head_dim

    def expert_fraction(self, batch: int) -> float:
        """Expected fraction of a layer's experts a decode batch touches (uniform routing): the
        weight bytes an MoE decode step reads grow with the batch until every expert is read."""
        if not self.experts:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_token / self.experts) ** max(batch, 0)

    def weight_bytes_read(self, batch: int, dtype_bytes: int) -> float:
        """Bytes of weights one decode forward reads for a batch of `batch` sequences."""
        dense = self.layers * self.attn_params + self.vocab * self.hidden
        if not self.experts:
            return (dense + self.layers * self.mlp_params) * dtype_bytes
        experts = self.layers * self.experts * self.expert_params * self.expert_fraction(batch)
        return (dense + self.layers * self.always_params + experts) * dtype_bytes


def _qwen2(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied):
    return ModelShape(
        name,
        hidden,
        layers,
        heads,
        kv_heads,
        hidden // heads,
        intermediate,
        vocab,
        tied_embeddings=tied,
        qkv_bias=True,
    )


def _qwen3(name, hidden, layers, heads, kv_heads, intermediate, tied):
    return ModelShape(name, hidden, layers, heads, kv_heads, 128, intermediate, 151936, tied_embeddings=tied)


MODELS: dict[str, ModelShape] = {
    # huggingface.co/Qwen/Qwen2.5-{3B,7B,14B,32B}/config.json (hidden, layers, heads, kv heads, intermediate, vocab)
    "qwen2.5-3b": _qwen2("qwen2.5-3b", 2048, 36, 16, 2, 11008, 151936, True),  # 3.09B
    "qwen2.5-7b": _qwen2("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False),  # 7.62B
    "qwen2.5-14b": _qwen2("qwen2.5-14b", 5120, 48, 40, 8, 13824, 152064, False),  # 14.8B
    "qwen2.5-32b": _qwen2("qwen2.5-32b", 5120, 64, 40, 8, 27648, 152064, False),  # 32.8B
    # huggingface.co/Qwen/Qwen3-{1.7B,8B}/config.json (head_dim 128 in both)
    "qwen3-1.7b": _qwen3("qwen3-1.7b", 2048, 28, 16, 8, 6144, True),  # 1.72B (1.41B without embeddings)
    "qwen3-8b": _qwen3("qwen3-8b", 4096, 36, 32, 8, 12288, False),  # 8.19B
    # huggingface.co/Qwen/Qwen3-235B-A22B/config.json: 94 layers, 64 q / 4 kv heads of 128, 128 experts of
    # width 1536, 8 active per token; untied embeddings. 235B total, 22B active.
    "qwen3-235b-a22b": ModelShape(
        "qwen3-235b-a22b",
        4096,
        94,
        64,
        4,
        128,
        0,
        151936,
        experts=128,
        experts_per_token=8,
        expert_intermediate=1536,
    ),
    # huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/config.json: 24 layers, 16 heads of 128 (no GQA), q/k/v biased,
    # 60 experts of width 1408, 4 active per token, and a shared expert of 5632 every token goes through.
    # 14.3B total, 2.7B active.
    "qwen1.5-moe-a2.7b": ModelShape(
        "qwen1.5-moe-a2.7b",
        2048,
        24,
        16,
        16,
        128,
        5632,
        151936,
        qkv_bias=True,
        experts=60,
        experts_per_token=4,
        expert_intermediate=1408,
        shared_intermediate=5632,
    ),  # fmt: skip
    # tailrace's default policy (config.ArchConfig defaults; char tokenizer: 4 specials + 96 printable = 100)
    "tailrace-default": ModelShape("tailrace-default", 256, 4, 8, 4, 32, 512, 100, tied_embeddings=True),
}


def get_model(name: str) -> ModelShape:
    key = name.lower()
    if key not in MODELS:
        raise KeyError(f"unknown model preset {name!r}; use one of {', '.join(MODELS)}")
    return MODELS[key]
