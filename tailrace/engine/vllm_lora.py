"""The LoRA adapters a `VLLMEngine` serves (`load_adapter`, `GenRequest.adapter`), as vLLM's LoRA
requests.

vLLM takes an adapter as PEFT files on disk (`LoRARequest(name, int_id, path)`) and batches rows of
different adapters in one forward: the base GEMMs once, each row's low-rank terms gathered by its
adapter (punica; `PunicaWrapperCPU` on CPU). So `load` writes the adapter's PEFT files into a scratch
directory (in memory where /dev/shm exists), registers it under a fresh id (`add_lora`: the files are
read now, so a bad adapter fails here, not at a request), and requests naming it carry that id.

vLLM keys an adapter's weights by its id, so new weights under a held name take a new id: requests
already waiting or running keep the id they were added with and finish on the weights they started
with; the old id and its files go once no request uses them (`release`). Dropping a name in use is
refused, as tailrace's engine refuses it.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from itertools import count
from pathlib import Path

from tailrace.engine.errors import EngineError
from tailrace.model import fused
from tailrace.model.config import ModelConfig
from tailrace.model.lora import Adapter, save_peft

# the ranks vLLM's LoRA slots come in (vllm.config.lora.MaxLoRARanks)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def slot_rank(rank: int) -> int:
    """The smallest rank vLLM's LoRA slots take that holds adapters of rank `rank`."""
    fit = [r for r in VLLM_RANKS if r >= rank]
    if rank < 1 or not fit:
        raise EngineError(f"LoRA rank {rank}: vLLM serves ranks 1 to {VLLM_RANKS[-1]}; use one in that range")
    return fit[0]


class VLLMAdapters:
    def __init__(self, llm, rank: int, per_step: int, base: ModelConfig):
        """`llm`: the `LLMEngine` (built with enable_lora); `rank`: the largest rank its slots take;
        `per_step`: adapters whose rows share one step (its max_loras); `base`: its model's config (a
        fused family's adapters are written for its fused modules, `fused.rank_factor` times wider)."""
        self._llm, self.rank, self.per_step, self.base = llm, rank, per_step, base
        self._wide = fused.rank_factor(base)
        self.max_rank = rank // self._wide  # the largest adapter rank it takes
        scratch = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self._root = Path(tempfile.mkdtemp(prefix="tailrace-vllm-lora-", dir=scratch))
        weakref.finalize(self, shutil.rmtree, str(self._root), True)
        self._ids = count(1)
        self._named: dict[str, int] = {}  # name -> the id its new requests get
        self._requests: dict[int, object] = {}  # id -> its LoRARequest
        self._users: dict[int, int] = {}  # id -> requests waiting or running with it (an id no name
        # holds any more, replaced or dropped, is removed once it has none)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._named)

    def load(self, name: str, adapter: Adapter) -> None:
        from vllm.lora.request import LoRARequest

        if not name:
            raise EngineError("load_adapter: an adapter needs a name ('' is the base model)")
        if adapter.rank > self.max_rank:
            raise EngineError(
                f"load_adapter({name!r}): rank {adapter.rank} exceeds the rank {self.max_rank} this engine "
                "was built for; build it with lora_rank >= the adapter's"
            )
        lid = next(self._ids)
        path = self._root / str(lid)
        save_peft(adapter, path, cfg=self.base)
        req = LoRARequest(name, lid, str(path))
        try:
            ok = self._llm.add_lora(req)
        except (ValueError, RuntimeError) as e:
            shutil.rmtree(path, ignore_errors=True)
            raise EngineError(
                f"load_adapter({name!r}): vLLM refused the adapter: {str(e).splitlines()[0]}"
            ) from e
        if not ok:
            shutil.rmtree(path, ignore_errors=True)
            raise EngineError(f"load_adapter({name!r}): vLLM refused the adapter; report this")
        old = self._named.get(name)
        self._named[name], self._requests[lid], self._users[lid] = lid, req, 0
        if old is not None:
            self._remove_unused(old)

    def drop(self, name: str) -> None:
        lid = self._named.get(name)
        if lid is None:
            raise EngineError(f"drop_adapter({name!r}): not loaded; loaded: {list(self._named)}")
        if self._users[lid]:
            raise EngineError(
                f"drop_adapter({name!r}): {self._users[lid]} request(s) of it are waiting or running; "
                "abort them or let them finish first"
            )
        del self._named[name]
        self._remove_unused(lid)

    def take(self, name: str):
        """The LoRARequest a new request of adapter `name` carries ("": none, the base), now in use."""
        if not name:
            return None
        lid = self._named.get(name)
        if lid is None:
            raise EngineError(
                f"adapter {name!r} not loaded; loaded: {list(self._named)}; load_adapter it first"
            )
        self._users[lid] += 1
        return self._requests[lid]

    def release(self, lora_request) -> None:
        """A request carrying `lora_request` (None: the base) finished or was aborted."""
        if lora_request is None:
            return
        lid = lora_request.lora_int_id
        self._users[lid] -= 1
        if lid not in self._named.values():
            self._remove_unused(lid)

    def _remove_unused(self, lid: int) -> None:
        """Remove id `lid`, which no name holds any more, once no request uses it."""
        if self._users[lid]:
            return
        self._llm.remove_lora(lid)
        shutil.rmtree(self._root / str(lid), ignore_errors=True)
        del self._users[lid], self._requests[lid]
