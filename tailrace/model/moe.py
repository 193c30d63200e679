"""Qwen3-MoE's, Qwen2-MoE's, OLMoE's, Mixtral's and Granite's mixture of experts: a router and
`num_experts` SwiGLU experts in place of a layer's MLP, and Qwen2-MoE's shared expert beside them (`shared`).

Each token's router logits (E,) go through a softmax in fp32; the token takes its `num_experts_per_tok`
(k) likeliest experts, their probabilities renormalized to sum to 1 where `norm_topk_prob`, rounded to
the logits' dtype, and its output is the sum of those experts' outputs, each times its weight, added in
increasing expert order — transformers' Qwen3MoeSparseMoeBlock (OLMoE's alike; Mixtral's keeps its weights
in fp32, a difference of bf16 rounding in a bf16 forward), whose parameter names these keep
(`mlp.gate.weight`, `mlp.experts.{e}.gate_proj.weight`: the checkpoints' own, one matrix per expert).

`mix` is the one computation the trainer's decoder and the engine's backends share: the tokens sorted
by expert once, each expert run over its tokens as one GEMM (an expert no token chose costs nothing),
the weighted outputs scattered back in one `index_add_`. The load-balancing loss (`balancing`,
`balance_loss`) is transformers' (its `router_aux_loss_coef`, added when a config sets
`output_router_logits`, as TRL's trainers then add it): off unless `train.moe_aux_loss` is set.

Routing replay (R3, `train.routing_replay`): the rollout engine records the experts each position's
forward chose (its KV cache holds them beside the keys, `routes_of` reads them back) and the trainer's
forward takes those experts instead of choosing afresh (`replaying`), their weights from its own router,
so the router still learns. A bf16 engine and a bf16 trainer round differently, and a near-tie between
two experts' logits then flips, a different expert's output added: the logprob gap an MoE's RL is known
for (bench/routing_replay.py measures it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from itertools import accumulate

import torch
from torch import nn

from tailrace.common import padded_rows
from tailrace.model.config import ModelConfig

Record = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (probs, own, used): `route`


def route(
    logits: torch.Tensor, k: int, norm: bool, given: torch.Tensor | None = None, record: Record | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, k) in the logits' dtype, experts (N, k)) of router logits (N, E). `given` (N, k):
    experts chosen elsewhere (routing replay), a row of -1 (none given) choosing afresh; the weights are
    then this router's probabilities of the experts given. `record(probs, own, used)` is called with the
    router's probabilities (N, E) fp32, the experts it chose and those the rows take (N, k)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, own = torch.topk(probs, k, dim=-1)
    experts = own
    if given is not None:
        experts = torch.where(given >= 0, given.long(), own)
        top = probs.gather(1, experts)
    if record is not None:
        record(probs, own, experts)
    if norm:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), experts


def mix(
    x: torch.Tensor,
    logits: torch.Tensor,
    k: int,
    norm: bool,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
    pad: bool = False,
    load: list[int] | None = None,
    given: torch.Tensor | None = None,
    record: Record | None = None,
) -> torch.Tensor:
    """sum over each row's k experts of weight x expert(e, row), (N, hidden) in x's dtype: x (N, hidden)
    the MLP's input, `logits` (N, E) the router's, `expert(e, rows)` expert e's output over those rows.
    `pad`: each expert runs over `padded_rows` of its count (rows of zeros, weighted 0, scattered to a row
    dropped after): where oneDNN compiles a kernel for every GEMM shape it meets (bf16 autocast on CPU),
    a count that changes with every batch compiled one at nearly every call. `load`: each expert's count
    of the tokens routed to it is added to it. `given`, `record`: see `route`. One row (a decode step of one
    sequence: a rollout's tail) skips the sort, gathers and scatter (`_one_row`: the same values)."""
    if not x.shape[0]:
        return torch.zeros_like(x)
    weights, experts = route(logits, k, norm, given, record)
    if x.shape[0] == 1 and not pad:
        return _one_row(x, weights, experts, expert, load)
    return _rows(x, weights, experts, logits.shape[-1], expert, pad, load)


def _rows(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, E: int, expert: Callable,
    pad: bool, load: list[int] | None,
) -> torch.Tensor:  # fmt: skip
    """`mix` after routing: the rows sorted by expert, each expert over its rows as one GEMM, the weighted
    outputs scattered back."""
    N, k = experts.shape
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)  # the (token, choice) slots by expert, tokens in order within one
    counts = torch.bincount(flat, minlength=E).tolist()  # one host sync per layer
    if load is not None:
        load[:] = [a + b for a, b in zip(load, counts)]
    token, w = order // k, weights.reshape(-1, 1).index_select(0, order)
    sizes = [padded_rows(n) for n in counts] if pad else counts
    if pad:  # each slot moved past the padding of the experts before its own; pads read and write row N
        before = torch.tensor(
            [0, *accumulate(s - n for s, n in zip(sizes[:-1], counts[:-1]))], device=x.device
        )
        at = torch.arange(len(order), device=x.device) + before.repeat_interleave(
            torch.tensor(counts, device=x.device)
        )
        token = torch.full((sum(sizes),), N, device=x.device).index_copy_(0, at, token)
        w = torch.zeros(sum(sizes), 1, dtype=w.dtype, device=x.device).index_copy_(0, at, w)
        x = torch.cat((x, x.new_zeros(1, x.shape[1])))
    xs = x.index_select(0, token)
    parts, at = [], 0
    for e, n in enumerate(sizes):
        if n:
            parts.append(expert(e, xs[at : at + n]))
            at += n
    ys = torch.cat(parts) if len(parts) > 1 else parts[0]
    out = torch.zeros_like(x).index_add_(0, token, (ys * w.to(ys.dtype)).to(x.dtype))
    return out[:N] if pad else out


def _one_row(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, expert: Callable, load: list[int] | None
) -> torch.Tensor:
    """`mix` over one row without the sort, the gathers and the scatter: the row's experts in increasing
    order, each output times its weight added to zeros in that order, in fp32 for a bf16 row and rounded
    once, as `_rows`' `index_add_` adds them on CPU (the same values, bit for bit)."""
    chosen = experts[0].tolist()  # one host sync, as `mix`'s counts
    if load is not None:
        for e in chosen:
            load[e] += 1
    out = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32))
    for j in sorted(range(len(chosen)), key=chosen.__getitem__):
        y = expert(chosen[j], x)
        out += (y * weights[:, j : j + 1].to(y.dtype)).to(x.dtype)
    return out.to(x.dtype)


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory experts (`mlp.experts.gate_up_proj` (E, 2 I, hidden): each expert's gate
    rows then its up rows; `mlp.experts.down_proj` (E, hidden, I)) as the checkpoints name them, one
    matrix per expert (`mlp.experts.{e}.gate_proj.weight` ...): views, no copy."""
    out = {}
    for k, v in state.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            at, half = k.removesuffix("gate_up_proj"), v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{at}{e}.gate_proj.weight"], out[f"{at}{e}.up_proj.weight"] = v[e, :half], v[e, half:]
        elif k.endswith(".mlp.experts.down_proj"):
            at = k.removesuffix("down_proj")
            out |= {f"{at}{e}.down_proj.weight": v[e] for e in range(v.shape[0])}
        else:
            out[k] = v
    return out


_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # its experts' names on disk: ours
# Granite's MoE on disk: each layer's experts stacked (gate rows then up rows, as transformers 5 stacks every
# MoE in memory) and its router (`router.weight` in transformers 5's memory); the rest of `block_sparse_moe.`
# is `mlp.`, as Mixtral's
_GRANITE = {
    ".block_sparse_moe.input_linear.weight": ".block_sparse_moe.experts.gate_up_proj",
    ".block_sparse_moe.output_linear.weight": ".block_sparse_moe.experts.down_proj",
    ".block_sparse_moe.router.layer.weight": ".block_sparse_moe.gate.weight",
    ".block_sparse_moe.router.weight": ".block_sparse_moe.gate.weight",
}


def as_ours(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's or transformers 5's tensors of a mixture of experts under the decoder's names, one
    matrix per expert (views, no copy): Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` are
    `mlp.experts.{e}.gate_proj/up_proj/down_proj`, Granite's stacked `input_linear` / `output_linear` and
    `router.layer`, and transformers 5's stacked experts, split (`split_experts`); others as they are."""
    out = {}
    for k, v in state.items():
        old = next((o for o in _GRANITE if k.endswith(o)), None)
        k = k.removesuffix(old) + _GRANITE[old] if old else k
        out[_renamed(k, ".block_sparse_moe.", ".mlp.", _MIXTRAL)] = v
    return split_experts(out)


def to_disk(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The decoder's tensors as `cfg`'s checkpoints hold them: `as_ours` undone for Mixtral (names) and
    Granite's MoE (each layer's experts stacked: a copy)."""
    if cfg.model_type == "mixtral":
        back = {v: k for k, v in _MIXTRAL.items()}
        return {_renamed(k, ".mlp.", ".block_sparse_moe.", back): v for k, v in state.items()}
    if cfg.model_type != "granitemoe":
        return state
    out = {k: v for k, v in state.items() if ".mlp." not in k}
    for i in range(cfg.num_hidden_layers):
        at, experts = f"model.layers.{i}.", range(cfg.num_experts)
        e = f"{at}mlp.experts."
        out[f"{at}block_sparse_moe.router.layer.weight"] = state[f"{at}mlp.gate.weight"]
        out[f"{at}block_sparse_moe.input_linear.weight"] = torch.stack(
            [torch.cat((state[f"{e}{j}.gate_proj.weight"], state[f"{e}{j}.up_proj.weight"])) for j in experts]
        )
        out[f"{at}block_sparse_moe.output_linear.weight"] = torch.stack(
            [state[f"{e}{j}.down_proj.weight"] for j in experts]
        )
    return out


def _renamed(key: str, old: str, new: str, experts: dict[str, str]) -> str:
    if old not in key:
        return key
    parts = key.replace(old, new).split(".")
    if len(parts) > 4 and parts[-4] == "experts" and parts[-2] in experts:  # ...experts.{e}.w1.weight
        parts[-2] = experts[parts[-2]]
    return ".".join(parts)


def shared(x: torch.Tensor, gate: Callable, expert: Callable) -> torch.Tensor:
    """Qwen2-MoE's shared expert over x (N, hidden), added to the routed experts' sum: sigmoid(gate(x))
    (N, 1) times expert(x), as transformers' Qwen2MoeSparseMoeBlock."""
    return torch.sigmoid(gate(x)) * expert(x)


class SparseMoE(nn.Module):
    """A sparse layer's MLP: `gate` (the router, E x hidden) and `experts`, each a SwiGLU MLP of width
    moe_intermediate_size; Qwen2-MoE's also `shared_expert` (a SwiGLU MLP of width
    shared_expert_intermediate_size) and `shared_expert_gate` (1 x hidden)."""

    def __init__(self, cfg: ModelConfig, mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.k, self.norm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(mlp(cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = mlp(cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.load = [0] * cfg.num_experts  # tokens routed to each expert since `take_load` last read it
        self.given: torch.Tensor | None = None  # (..., k) the experts to take (`replaying`), -1: choose
        # inside `balancing`: (the rows counted, how many, the stats list)
        self.balance: tuple[torch.Tensor, int, list] | None = None
        self.flips: torch.Tensor | None = None  # rows replayed, and of them routed otherwise here (counts)
        # gradient checkpointing (`decoder.recomputed`): a list the forward appends the experts it took to
        # (and `balance`); or, for the backward's second run of the layer, that entry: taken again, nothing
        # counted
        self.kept: list[tuple[torch.Tensor, tuple | None]] | None = None
        self.again: tuple[torch.Tensor, tuple | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        load, balance = self.load, self.balance
        take = given = None if self.given is None else self.given.reshape(-1, self.k)
        if self.again is not None:  # a recompute: the first run's experts, and its statistics' graph
            (take, balance), given, load = self.again, None, None  # for autograd: nothing counted
            balance = balance and (*balance[:2], [])
        elif self.kept is not None and given is None:  # routed as the recompute will route (experts
            # given; -1: none), so that autograd keeps the same tensors in both runs
            take = torch.full((len(x), self.k), -1, device=x.device)
        watch = given is not None or balance is not None or self.kept is not None
        y = mix(
            x, self.gate(x), self.k, self.norm, self._expert, pad=_compiles_shapes(x), load=load,
            given=take, record=partial(self._observe, given, balance) if watch else None,
        )  # fmt: skip
        if hasattr(self, "shared_expert"):
            y = y + shared(x, self.shared_expert_gate, partial(_run, self.shared_expert))
        return y.reshape(shape)

    def _observe(
        self, given: torch.Tensor | None, balance: tuple | None, probs: torch.Tensor, own: torch.Tensor,
        used: torch.Tensor,
    ) -> None:  # fmt: skip
        """Routing replay: the rows replayed, and of them those whose experts this router would not have
        chosen. `balancing`: the router's choices and probabilities over the forward's real rows. `kept`:
        the experts the rows took, and the balancing statistics' context."""
        if self.kept is not None:
            self.kept.append((used.detach(), balance))
        if given is not None:
            set_ = given[:, 0] >= 0
            differ = (own.sort(-1).values != used.sort(-1).values).any(-1) & set_
            counts = torch.stack((set_.sum(), differ.sum()))
            self.flips = counts if self.flips is None else self.flips + counts
        if balance is not None:
            valid, n, stats = balance
            stats.append(
                (torch.bincount(own[valid].reshape(-1), minlength=probs.shape[-1]), probs[valid].sum(0), n)
            )

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return _run(self.experts[e], rows)


def _run(mlp: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """An expert over `rows`; outside autocast, in its weights' dtype (a LoRA trainer keeps the frozen
    experts in bf16: `lora.store_frozen_projections`), the output in the rows'."""
    dtype = mlp.gate_proj.weight.dtype
    if dtype == rows.dtype or torch.is_autocast_enabled(rows.device.type):
        return mlp(rows)
    return mlp(rows.to(dtype)).to(rows.dtype)


def _compiles_shapes(x: torch.Tensor) -> bool:
    """Whether the GEMMs over x run where oneDNN compiles a kernel for every shape: bf16 on CPU (autocast or
    not). fp32 GEMMs there are MKL's, which padding only slows (bench/moe_trainer.py --fp32: 0.96x)."""
    return x.device.type == "cpu" and (torch.is_autocast_enabled("cpu") or x.dtype != torch.float32)


def take_load(model: nn.Module) -> dict[str, float]:
    """How evenly the sparse layers of `model` spread the tokens routed since the last call (over its
    forwards: a trainer step's, the old policy's and the reference's alike), then zeroed: `moe_load_max`,
    the busiest expert's share over an even one's (1: even; E: all to one), averaged over layers, and
    `moe_idle`, the fraction of (layer, expert) pairs no token reached. {} for a model without experts or
    before any token."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    loads = [m.load for m in layers if sum(m.load)]
    replayed, flipped = (sum(m.flips[i].item() for m in layers if m.flips is not None) for i in (0, 1))
    for m in layers:
        m.load = [0] * len(m.load)
        m.flips = None
    if not loads:
        return {}
    out = {
        "moe_load_max": sum(max(load) * len(load) / sum(load) for load in loads) / len(loads),
        "moe_idle": sum(load.count(0) for load in loads) / sum(len(load) for load in loads),
    }
    if replayed:  # routing replay: the (position, layer)s whose replayed experts this router would not pick
        out["moe_route_flips"] = flipped / replayed
    return out


@contextmanager
def replaying(model: nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Inside, each sparse layer j of `model` takes the experts `routes[:, :, j]` names ((B, T, L, k) for a
    forward over (B, T) tokens; -1: choose afresh); None: no replay."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if routes is None or not layers:
        yield
        return
    if routes.shape[2] != len(layers):
        raise ValueError(f"routes of {routes.shape[2]} sparse layers for a model of {len(layers)}")
    for j, m in enumerate(layers):
        m.given = routes[:, :, j]
    try:
        yield
    finally:
        for m in layers:
            m.given = None


@contextmanager
def balancing(model: nn.Module, valid: torch.Tensor | None) -> Iterator[list]:
    """Inside, each sparse layer's forward adds its statistics for `balance_loss` to the list yielded,
    over the rows `valid` ((B, T) bool for a forward over (B, T) tokens: padding left out, as transformers'
    attention mask does); None: nothing kept."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    stats: list = []
    if valid is not None:
        rows = valid.reshape(-1)
        n = int(rows.sum())
        for m in layers:
            m.balance = (rows, n, stats)
    try:
        yield stats
    finally:
        for m in layers:
            m.balance = None


def balance_loss(stats: list, num_experts: int) -> torch.Tensor:
    """transformers' load-balancing loss (`load_balancing_loss_func`) of one forward: the sparse layers'
    rows pooled, E x sum over experts e of (the share of the rows' k choices that went to e, times k) x
    (e's mean router probability); k when even, k E when all go to the same k. Differentiable through the
    probabilities (the choices are counts)."""
    rows = sum(n for _, _, n in stats)
    counts = sum(c for c, _, _ in stats).float()
    probs = sum(p for _, p, _ in stats)
    return num_experts * (counts / max(rows, 1) * probs / max(rows, 1)).sum()


def sparse_layers(cfg: ModelConfig) -> int:
    return sum(cfg.moe_at(i) for i in range(cfg.num_hidden_layers))


def routes_of(data: bytes, cfg: ModelConfig) -> torch.Tensor:
    """The routes an engine recorded (`GenResult.routes`: uint8, per position, per sparse layer, its k
    experts) as (positions, sparse layers, k) int16."""
    per = sparse_layers(cfg) * cfg.num_experts_per_tok
    if len(data) % per:
        raise ValueError(f"{len(data)} bytes of routes are not whole positions of {per} experts each")
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    return t.view(-1, sparse_layers(cfg), cfg.num_experts_per_tok).to(torch.int16)
