"""`SharedBase`: one copy of a LoRA run's frozen base in shared memory, for all its trainers on a machine.

In a run of several LoRA policies (tenants) each policy's trainer is a process of its own, and each
would load the whole base: P copies of weights none of them changes. A tensor the checkpoint stores as
the trainers hold it (fp32) is no such copy: a trainer's load maps it from the checkpoint's file, and
the page cache keeps one copy for every process that maps it (the engines' too). The others are: a
bf16 checkpoint's tensors, converted to fp32, and the adapted projections (and an MoE's experts) kept
in bf16 where the trainers autocast to it and bf16 holds them exactly, as
`lora.store_frozen_projections` would keep them. The driver puts those into shared memory once
(`share`); every trainer builds its model over them and maps the rest (`model`), so the machine holds
one base whatever the number of tenants — the trainer side of MARLaaS's one frozen base (the engines
already hold one: `engine.adapter_versions`). Where every tensor would be mapped, nothing is shared (a
copy in shared memory would only add one).

Local CPU trainers only (a GPU trainer's base lives on its device; a Ray actor may be on another
host). Where shared memory cannot hold the base, `share` says why and each trainer loads its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tailrace.common import one_line
from tailrace.config.train import LoraConfig
from tailrace.model.checkpoint import load_pretrained, read_config, stored_state
from tailrace.model.decoder import CausalLM
from tailrace.model.lora import exactly_in, stored_low
from tailrace.runtime.procs import release_memory


@dataclass
class SharedBase:
    model_path: str
    tensors: dict[str, torch.Tensor]  # in shared memory, keyed as the model's state dict (ties once)
    mapped: tuple[str, ...] = ()  # the rest: each trainer maps them from the checkpoint's files

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in self.tensors.values()}.values())

    def model(self) -> CausalLM:
        """A model whose parameters are the shared tensors and the mapped ones (no copy of either):
        frozen, the trainer's base."""
        cfg = read_config(self.model_path)
        with torch.device("meta"):  # no init work; the RoPE tables are built on the CPU regardless
            model = CausalLM(cfg)
        stored = stored_state(self.model_path, cfg) if self.mapped else {}
        model.load_state_dict(
            {**self.tensors, **{n: stored[n] for n in self.mapped}}, strict=False, assign=True
        )
        model.tie_weights()
        empty = next((n for n, t in model.state_dict().items() if t.is_meta), None)
        if empty is not None:  # neither shared nor mapped: `share` and the checkpoint disagree
            raise RuntimeError(
                f"{self.model_path}: the shared base has no tensor {empty!r}; was the checkpoint changed?"
            )
        return model.requires_grad_(False)


def share(model_path: str | Path, lora: LoraConfig, bf16: bool) -> tuple[SharedBase | None, str]:
    """The base of `model_path` in shared memory (what a trainer's own load would copy), or None and why
    not. The whole model it read to decide is given back to the OS before it returns (else the driver
    holds its heap's share of it all run long: 465 MB on a 106M-parameter bf16 checkpoint)."""
    try:
        return _share(model_path, lora, bf16)
    finally:
        release_memory()


def _share(model_path: str | Path, lora: LoraConfig, bf16: bool) -> tuple[SharedBase | None, str]:
    model = load_pretrained(model_path, dtype=torch.float32)
    stored = stored_state(model_path, model.config)
    # by the data's place: a tied weight is one tensor under two names (state_dict gives each its own
    # tensor object), stored under one of them (the embedding's)
    names: dict[str, tuple] = {}
    by_key: dict[tuple, list[str]] = {}
    state = model.state_dict()
    for name, t in state.items():
        names[name] = key = (t.data_ptr(), tuple(t.shape))
        by_key.setdefault(key, []).append(name)
    tensors: dict[tuple, torch.Tensor] = {}
    mapped: dict[tuple, str] = {}  # the name each trainer maps it by
    for key, tied in by_key.items():
        t = state[tied[0]]
        low = exactly_in(t, torch.bfloat16) if bf16 and stored_low(tied[0], lora.targets) else None
        kept = [n for n in tied if n in stored and stored[n].dtype == t.dtype]
        if low is None and kept:
            mapped[key] = kept[0]  # stored as held: a trainer's load maps it, shared by the page cache
        else:
            tensors[key] = t if low is None else low
    if not tensors:
        return None, (
            "each trainer maps the base from the checkpoint's files: stored as they hold it (fp32), "
            "the page cache keeps one copy for all"
        )
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
    base = SharedBase(
        str(model_path),
        {name: views[key] for name, key in names.items() if key in views},
        tuple(mapped.values()),
    )
    rest = sum(stored[n].numel() * stored[n].element_size() for n in base.mapped)
    also = f"; {rest / 1e6:,.1f} MB more mapped from the checkpoint's files" if rest else ""
    return (
        base,
        f"the trainers share one copy of the base in shared memory ({base.nbytes / 1e6:,.1f} MB{also})",
    )
