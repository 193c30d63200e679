"""Tiny random models, request builders and reference KV-cache contents for the engine tests."""

from __future__ import annotations

import torch

from tailrace.engine.backends import Backend
from tailrace.engine.kv_cache import KVCache
from tailrace.model.config import ModelConfig
from tailrace.model.decoder import CausalLM
from tailrace.model.rope import apply_rope
from tailrace.types import GenRequest, SamplingParams

VOCAB = 97


def tiny_config(**kw) -> ModelConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    base.update(kw)
    return ModelConfig(**base)


# Qwen3-MoE's layout on the tiny shape: a sparse layer of four experts (two a token) and a dense one
MOE = dict(
    model_type="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    mlp_only_layers=(1,),
)
QWEN2_MOE = dict(MOE, model_type="qwen2_moe", shared_expert_intermediate_size=40)  # its shared expert too


def tiny_model(seed: int = 0, **kw) -> CausalLM:
    return CausalLM.from_config(tiny_config(**kw), seed=seed).eval()


def prompt(seed: int, n: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist())


def req(
    rid: str,
    n_prompt: int,
    max_new: int,
    seed: int | None = None,
    version: int = 0,
    pseed: int | None = None,
    **params,
) -> GenRequest:
    """A request whose prompt (and seed, unless given) derive from its id, or from `pseed`."""
    h = sum(map(ord, rid)) if pseed is None else pseed
    return GenRequest(
        rid,
        prompt(h, n_prompt),
        SamplingParams(max_new_tokens=max_new, seed=h if seed is None else seed, **params),
        version=version,
    )


@torch.no_grad()
def full_logprobs(model: CausalLM, prompt_ids, token_ids, temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of a full-sequence forward at each generated token."""
    ids = torch.tensor([tuple(prompt_ids) + tuple(token_ids)])
    logits = model(ids)[0, len(prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return lp.gather(1, torch.tensor(token_ids)[:, None]).squeeze(1).tolist()


@torch.no_grad()
def reference_kv(model: CausalLM, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v), each (B, Hkv, T, D), of the whole-sequence forward of ids (B, T): k after RoPE
    (none in SmolLM3's layers without; OLMo3's sliding layers' by their table; Qwen3's, OLMo2's or OLMoE's k norm
    before it), in the model's dtype, as a
    KV cache holds them."""
    cfg = model.config
    k_from = "k_norm" if cfg.qk_norm or cfg.qk_norm_wide else "k_proj"
    B, T = ids.shape
    Hkv, D = cfg.num_key_value_heads, cfg.head_dim
    out: dict[tuple[int, str], torch.Tensor] = {}
    hooks = [
        getattr(layer.self_attn, name).register_forward_hook(
            lambda mod, args, y, key=(i, name): out.__setitem__(key, y)
        )
        for i, layer in enumerate(model.model.layers)
        for name in (k_from, "v_proj")
    ]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    tables = [model.rotary.prefix(T)]  # OLMo3's sliding layers: by their own table
    if model.local_rotary is not None:
        tables.append(model.local_rotary.prefix(T))
    rope = lambda i, k: apply_rope(k, *tables[len(tables) > 1 and cfg.local_at(i)]) if cfg.rope_at(i) else k  # noqa: E731
    return [
        (
            rope(i, out[i, k_from].view(B, T, Hkv, D)).transpose(1, 2),
            out[i, "v_proj"].view(B, T, Hkv, D).transpose(1, 2),
        )
        for i in range(cfg.num_hidden_layers)
    ]


def paged_cache(
    model: CausalLM, rows: int, max_context: int, block_size: int = 8, dtype=None, seed: int = 0
) -> KVCache:
    """A cache whose `rows` rows each own blocks for `max_context` positions, drawn at random from a pool
    with a few spare blocks: a row's blocks are neither contiguous nor in order. The same seed gives the
    same layout."""
    W = -(-max_context // block_size)
    cache = KVCache.for_model(model, rows * W + 3, block_size, rows, max_context, dtype)
    perm = torch.randperm(rows * W + 3, generator=torch.Generator().manual_seed(seed))[: rows * W]
    cache.table.t.copy_(perm.view(rows, W))
    return cache


def _flat(cache: KVCache, row: int, n: int) -> torch.Tensor:
    """(Hkv, n) indices into c.view(-1, D) of positions [0, n) of `row`, per kv head."""
    bs, Hkv = cache.block_size, cache.k[0].shape[1]
    p = torch.arange(n)
    blk = cache.table.t[row, p // bs].long()
    return (blk[None, :] * Hkv + torch.arange(Hkv)[:, None]) * bs + p % bs


def write_kv(cache: KVCache, row: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put `reference_kv`'s k/v of B sequences into positions [0, T) of cache rows row, row + 1, ..."""
    for layer, (k, v) in enumerate(kv):
        B, Hkv, T, D = k.shape
        for b in range(B):
            idx = _flat(cache, row + b, T).reshape(-1)
            cache.k[layer].view(-1, D)[idx] = k[b].reshape(-1, D).to(cache.dtype)
            cache.v[layer].view(-1, D)[idx] = v[b].reshape(-1, D).to(cache.dtype)


def read_kv(cache: KVCache, layer: int, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v), each (Hkv, n, D): positions [0, n) of cache row `row` in `layer`."""
    D = cache.k[0].shape[3]
    idx = _flat(cache, row, n)
    return cache.k[layer].view(-1, D)[idx], cache.v[layer].view(-1, D)[idx]


def forward_pieces(backend: Backend, cache: KVCache, pieces: list[tuple[int, int, torch.Tensor]]):
    """A step of prefill pieces only, (row, start, token ids) each; logits (tokens, V) of every token."""
    tokens = torch.cat([ids for _, _, ids in pieces])
    positions = torch.cat([torch.arange(start, start + len(ids)) for _, start, ids in pieces])
    spans = [(row, start, len(ids)) for row, start, ids in pieces]
    want = torch.arange(tokens.shape[0])
    return backend.forward(tokens, positions, cache, slice(0, 0), [], spans, want)
