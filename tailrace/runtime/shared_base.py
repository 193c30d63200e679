"""`SharedBase`: one copy of a LoRA run's frozen base in shared memory, for all its trainers on a machine.

In a run of several LoRA policies (tenants) each policy's trainer is a process of its own, and each
would load the whole base: P copies of weights none of them changes. The driver instead loads the base
once into shared memory (`share`: the adapted projections, and an MoE's experts, already in bf16 when
the trainers autocast to it and bf16 holds them exactly, as `lora.store_frozen_projections` would keep
them) and every trainer builds its model over those tensors (`model`), so the machine holds one base
whatever the number of tenants — the trainer side of MARLaaS's one frozen base (the engines already
hold one: `engine.adapter_versions`).

Local CPU trainers only (a GPU trainer's base lives on its device; a Ray actor may be on another
host). Where shared memory cannot hold the base, `share` says why and each trainer loads its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tailrace.common import one_line
from tailrace.config.train import LoraConfig
from tailrace.model.checkpoint import load_pretrained, read_config
from tailrace.model.decoder import CausalLM
from tailrace.model.lora import exactly_in, stored_low


@dataclass
class SharedBase:
    model_path: str
    tensors: dict[str, torch.Tensor]  # in shared memory, keyed as the model's state dict (ties once)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in self.tensors.values()}.values())

    def model(self) -> CausalLM:
        """A model whose parameters are the shared tensors (no copy): frozen, the trainer's base."""
        with torch.device("meta"):  # no init work; the RoPE tables are built on the CPU regardless
            model = CausalLM(read_config(self.model_path))
        model.load_state_dict(self.tensors, strict=False, assign=True)
        model.tie_weights()
        return model.requires_grad_(False)


def share(model_path: str | Path, lora: LoraConfig, bf16: bool) -> tuple[SharedBase | None, str]:
    """The base of `model_path` in shared memory, or None and why not."""
    model = load_pretrained(model_path, dtype=torch.float32)
    tensors: dict[int, torch.Tensor] = {}  # by identity: a tied weight is one tensor under two names
    names: dict[str, int] = {}
    for name, t in model.state_dict().items():
        names[name] = id(t)
        low = exactly_in(t, torch.bfloat16) if bf16 and stored_low(name, lora.targets) else None
        tensors[id(t)] = t if low is None else low
    # one buffer a dtype: a worker receives each shared storage as a file descriptor, and a process
    # start passes at most a few hundred of them
    try:
        flat = {
            dt: torch.empty(
                sum(t.numel() for t in tensors.values() if t.dtype == dt), dtype=dt
            ).share_memory_()
            for dt in {t.dtype for t in tensors.values()}
        }
    except RuntimeError as e:  # /dev/shm full or too small (docker's default is 64 MB)
        return None, f"each trainer loads its own base: shared memory cannot hold it ({one_line(e)})"
    at = dict.fromkeys(flat, 0)
    views = {}
    for key, t in tensors.items():
        n = t.numel()
        views[key] = flat[t.dtype][at[t.dtype] : at[t.dtype] + n].view(t.shape)
        views[key].copy_(t)
        at[t.dtype] += n
    base = SharedBase(str(model_path), {name: views[key] for name, key in names.items()})
    return base, f"the trainers share one copy of the base in shared memory ({base.nbytes / 1e6:,.1f} MB)"
