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
from tailrace.model.checkpoint import read_config, stored_state
from tailrace.model.decoder import CausalLM
from tailrace.model.lora import exactly_in, stored_low


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
    not. Tensor by tensor from the mapped checkpoint: the driver never holds the model beside it (an
    fp32 copy of a bf16 checkpoint: twice its size)."""
    cfg = read_config(model_path)
    with torch.device("meta"):  # names and shapes; a tied weight is one parameter under two names
        params = CausalLM(cfg).state_dict(keep_vars=True)
    stored = stored_state(model_path, cfg)
    tied: dict[int, list[str]] = {}
    for name, p in params.items():
        tied.setdefault(id(p), []).append(name)
    held: list[tuple[list[str], str, torch.dtype]] = []  # (names, the stored one, the dtype a trainer holds)
    mapped: list[str] = []  # the rest: stored as a trainer holds them (fp32), mapped by each
    for names in tied.values():
        src = next((n for n in names if n in stored), None)
        if src is None:  # the checkpoint is not the one the run checked: its own load says why
            return None, f"each trainer loads its own base: {model_path} has no tensor {names[0]!r}"
        t = stored[src]
        low = (
            bf16
            and stored_low(names[0], lora.targets)
            and (t.dtype == torch.bfloat16 or exactly_in(t.float(), torch.bfloat16) is not None)
        )
        if not low and t.dtype == torch.float32:
            mapped.append(src)
        else:
            held.append((names, src, torch.bfloat16 if low else torch.float32))
    if not held:
        return None, (
            "each trainer maps the base from the checkpoint's files: stored as they hold it (fp32), "
            "the page cache keeps one copy for all"
        )
    # one buffer a dtype: a worker receives each shared storage as a file descriptor, and a process
    # start passes at most a few hundred of them
    try:
        flat = {
            dt: torch.empty(
                sum(stored[src].numel() for _, src, d in held if d == dt), dtype=dt
            ).share_memory_()
            for dt in {d for _, _, d in held}
        }
    except RuntimeError as e:  # /dev/shm full or too small (docker's default is 64 MB)
        return None, f"each trainer loads its own base: shared memory cannot hold it ({one_line(e)})"
    at = dict.fromkeys(flat, 0)
    tensors = {}
    for names, src, dt in held:
        t = stored[src]
        view = flat[dt][at[dt] : at[dt] + t.numel()].view(t.shape)
        view.copy_(t)  # converted on the way (exactly, where kept in bf16)
        at[dt] += t.numel()
        tensors |= dict.fromkeys(names, view)
    base = SharedBase(str(model_path), tensors, tuple(mapped))
    rest = sum(stored[n].numel() * stored[n].element_size() for n in base.mapped)
    also = f"; {rest / 1e6:,.1f} MB more mapped from the checkpoint's files" if rest else ""
    return (
        base,
        f"the trainers share one copy of the base in shared memory ({base.nbytes / 1e6:,.1f} MB{also})",
    )
