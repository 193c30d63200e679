"""`Adapters`: the LoRA adapters an engine holds, stacked so one forward serves rows of different ones.

Each adapter has a slot s while it is loaded (a freed slot is reused). Per layer and fused projection
of the backends (`FUSED`: qkv, o, gate_up, down, as `FusedWeights` fuses them) one pair of stacks,
A (S, T R, in) and B^T (S, T R, out) for the T targets of that projection and R the largest rank
loaded: target t's ranks are [t R, t R + r) and its columns of B^T the projection's columns for t;
everything else is zero, so an adapter of lower rank, or without that target, adds exact zeros. The
scale alpha / r is folded into B. Adapters are the engine's, not a version's: a row's adapter applies over whichever
weight version it runs on.

`LoraStep` is one forward's view (each token's slot; -1: none). `add(layer, kind, x, y, kernel)` adds
the low-rank terms to y in place after the base GEMM has run over every row once:
  * torch: rows grouped by slot on the host, then per group (x_g A_s^T) B_s^T (an index_select, two
    GEMMs and an index_add; when one slot has every row, two GEMMs and an add, rounded alike);
  * gathered (on CUDA, and wherever `gathered` says): each token's A and B^T gathered by its slot and
    two batched GEMMs of one row each (punica's BGMV): the launches do not grow with the adapters in
    the batch, which on a GPU costs more than the few MB gathered; bounded by `GATHER_MAX_BYTES`;
  * the C kernels (`Kernels.lora`): one call per projection, each row through its own slot's A and B
    (a row's terms never depend on the other rows).
x is the projection's input as the model sees it (the caller applies the RMSNorm weight that the
backends fold into the base GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tailrace.engine.ckernel import Kernels
from tailrace.engine.errors import EngineError
from tailrace.model.config import ModelConfig
from tailrace.model.lora import Adapter, adaptable

GATHER_MAX_BYTES = 256 << 20  # above: the per-slot groups (a big batch of a big model's MLP)

FUSED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class _Stack:
    a: torch.Tensor  # (S, T R, in)
    bt: torch.Tensor  # (S, T R, out): B transposed, scale folded in
    cols: torch.Tensor  # (T + 1,) int64: target t's columns of the projection's output
    ranks: torch.Tensor  # (T + 1,) int64: target t's ranks, [t R, (t + 1) R)


class Adapters:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        H, Hkv, D, hid, I = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
            cfg.intermediate_size,
        )
        # (in, out) of each target, as the model's nn.Linear weights are (out, in)
        self.dims = {
            "q_proj": (hid, H * D),
            "k_proj": (hid, Hkv * D),
            "v_proj": (hid, Hkv * D),
            "o_proj": (H * D, hid),
            "gate_proj": (hid, I),
            "up_proj": (hid, I),
            "down_proj": (I, hid),
        }
        self._slot: dict[str, int] = {}
        self._held: list[Adapter | None] = []  # by slot; None: free
        self._stacks: list[dict[str, _Stack]] = []  # per layer: fused projection -> stacks

    def __contains__(self, name: str) -> bool:
        return name in self._slot

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._slot))

    def slot(self, name: str) -> int:
        """The slot of adapter `name`; -1 for "" (no adapter)."""
        return self._slot[name] if name else -1

    def load(self, name: str, adapter: Adapter) -> None:
        """Add adapter `name`, or replace its weights (same slot) if it is loaded."""
        if not name:
            raise EngineError('load_adapter: give the adapter a name ("" means no adapter)')
        self._check(name, adapter)
        w = {  # copies: the caller's tensors may be views of a buffer that is written again
            site: (
                a.detach().to(self.device, torch.float32, copy=True),
                b.detach().to(self.device, torch.float32, copy=True),
            )
            for site, (a, b) in adapter.weights.items()
        }
        held = Adapter(adapter.rank, adapter.alpha, w)
        if name not in self._slot:
            free = [s for s, h in enumerate(self._held) if h is None]
            self._slot[name] = free[0] if free else len(self._held)
            if not free:
                self._held.append(None)
        self._held[self._slot[name]] = held
        self._place(self._slot[name])

    def drop(self, name: str) -> None:
        slot = self._slot.pop(name)
        self._held[slot] = None
        self._place(slot)

    def step(self, slots: list[int]) -> LoraStep | None:
        """The view of one forward whose tokens use these slots (None when none uses an adapter)."""
        return LoraStep(self, slots) if any(s >= 0 for s in slots) else None

    def stack(self, layer: int, kind: str) -> _Stack | None:
        return self._stacks[layer].get(kind)

    def _check(self, name: str, adapter: Adapter) -> None:
        L = self.cfg.num_hidden_layers
        for (i, t), (a, b) in adapter.weights.items():
            if not 0 <= i < L or t not in self.dims:
                raise EngineError(f"load_adapter({name!r}): layer {i} {t} is not in this {L}-layer model")
            if not adaptable(self.cfg, i, t):
                raise EngineError(
                    f"load_adapter({name!r}): layer {i} {t} is an MLP's of a mixture-of-experts model, which "
                    "adapters leave frozen; pass an adapter of the attention projections"
                )
            n_in, n_out = self.dims[t]
            if tuple(a.shape) != (adapter.rank, n_in) or tuple(b.shape) != (n_out, adapter.rank):
                raise EngineError(
                    f"load_adapter({name!r}): layer {i} {t} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                    f"the model wants ({adapter.rank}, {n_in}) and ({n_out}, {adapter.rank}); pass an "
                    "adapter of this base model"
                )

    def _place(self, slot: int) -> None:
        """Write the weights of `slot` (zeros when it is free) into the stacks in place when they have
        room for them (the slot, its rank, its targets); else build the stacks anew."""
        h = self._held[slot]
        stacks = self._stacks
        fits = (
            bool(stacks) and any(stacks) and slot < next(st.a.shape[0] for d in stacks for st in d.values())
        )
        if fits and h is not None:
            R = next(st.ranks[1].item() for d in stacks for st in d.values())
            fits = h.rank <= R and all(
                kind in stacks[i] for (i, t) in h.weights for kind, ts in FUSED.items() if t in ts
            )
        if not fits:
            self._restack()
            return
        for i, d in enumerate(stacks):
            for kind, st in d.items():
                self._fill(st, i, kind, slot, h)

    def _fill(self, st: _Stack, layer: int, kind: str, slot: int, h: Adapter | None) -> None:
        """Slot `slot` of one stack: `h`'s weights for the projection's targets, zeros elsewhere."""
        st.a[slot].zero_()
        st.bt[slot].zero_()
        if h is None:
            return
        R, cols = int(st.ranks[1]), st.cols.tolist()
        for j, t in enumerate(FUSED[kind]):
            if (layer, t) in h.weights:
                ta, tb = h.weights[layer, t]
                st.a[slot, j * R : j * R + h.rank] = ta.to(self.dtype)
                st.bt[slot, j * R : j * R + h.rank, cols[j] : cols[j + 1]] = (tb.t() * h.scale).to(self.dtype)

    def _restack(self) -> None:
        held = [h for h in self._held if h is not None]
        R = max((h.rank for h in held), default=0)
        S = len(self._held)
        self._stacks = [{} for _ in range(self.cfg.num_hidden_layers)]
        if not held:
            return
        for i in range(self.cfg.num_hidden_layers):
            for kind, targets in FUSED.items():
                if not any((i, t) in h.weights for h in held for t in targets):
                    continue
                n_in = self.dims[targets[0]][0]
                cols = [0]
                for t in targets:
                    cols.append(cols[-1] + self.dims[t][1])
                st = _Stack(
                    torch.zeros(S, len(targets) * R, n_in, dtype=self.dtype, device=self.device),
                    torch.zeros(S, len(targets) * R, cols[-1], dtype=self.dtype, device=self.device),
                    torch.tensor(cols, dtype=torch.int64),
                    torch.tensor([j * R for j in range(len(targets) + 1)], dtype=torch.int64),
                )
                for s, h in enumerate(self._held):
                    self._fill(st, i, kind, s, h)
                self._stacks[i][kind] = st


class LoraStep:
    """One forward's adapter terms; built by `Adapters.step`."""

    __slots__ = ("adapters", "slots", "_slot_t", "_groups", "_gather")

    def __init__(self, adapters: Adapters, slots: list[int]):
        self.adapters, self.slots = adapters, slots
        self._slot_t: torch.Tensor | None = None
        self._groups: list[tuple[int, torch.Tensor | None]] | None = None
        self._gather: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def add(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor, kernel: Kernels | None) -> None:
        """y (M, out) += each token's adapter terms of projection `kind` over its input x (M, in)."""
        st = self.adapters.stack(layer, kind)
        if st is None:
            return
        if kernel is not None and x.device.type == "cpu" and x.dtype in kernel.dtypes:
            kernel.lora(x.contiguous(), st.a, st.bt, self._slot_tensor(), y, st.cols, st.ranks)
            return
        if (
            gathered(x.device)
            and x.shape[0] * st.a.shape[1] * (st.a.shape[2] + st.bt.shape[2]) * x.element_size()
            <= GATHER_MAX_BYTES
        ):
            idx, keep = self._gather_index(x.device, x.dtype)
            xa = torch.bmm(x.unsqueeze(1), st.a.index_select(0, idx).transpose(1, 2))
            t = torch.bmm(xa, st.bt.index_select(0, idx)).squeeze(1)
            y.add_(t if keep is None else t * keep)
            return
        for s, idx in self._slot_groups(x.device):
            a, bt = st.a[s], st.bt[s]
            if idx is None:  # the same roundings as a group's: the terms rounded, then added
                y.add_((x @ a.t()) @ bt)
            else:
                y.index_add_(0, idx, (x.index_select(0, idx) @ a.t()) @ bt)

    def _gather_index(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each token's slot (0 for none) and, when some token has none, a (M, 1) mask zeroing its terms."""
        if self._gather is None:
            idx = torch.tensor([max(s, 0) for s in self.slots], dtype=torch.int64).to(
                device, non_blocking=True
            )
            keep = None
            if any(s < 0 for s in self.slots):
                m = torch.tensor([[float(s >= 0)] for s in self.slots], dtype=dtype)
                keep = m.to(device, non_blocking=True)
            self._gather = (idx, keep)
        return self._gather

    def _slot_tensor(self) -> torch.Tensor:
        if self._slot_t is None:
            self._slot_t = torch.tensor(self.slots, dtype=torch.int32)
        return self._slot_t

    def _slot_groups(self, device: torch.device) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, token indices) per slot used; None: every token (no gather)."""
        if self._groups is None:
            by: dict[int, list[int]] = {}
            for m, s in enumerate(self.slots):
                if s >= 0:
                    by.setdefault(s, []).append(m)
            whole = len(by) == 1 and len(next(iter(by.values()))) == len(self.slots)
            self._groups = [
                (s, None if whole else torch.tensor(ix).to(device, non_blocking=True)) for s, ix in by.items()
            ]
        return self._groups


def gathered(device: torch.device) -> bool:
    """Whether the torch path gathers each token's adapter (accelerators) or groups tokens by slot (CPU)."""
    return device.type != "cpu"
