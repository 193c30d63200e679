"""`TailraceEngine`: continuous batching of token-id requests over a paged KV cache. Knows nothing of
RL. tailrace's own implementation of the `Engine` protocol (see `protocol`).

Token ids in; token ids, per-token logprobs and per-token policy versions out. Slots (concurrent
requests) and KV memory are set independently: the cache is a pool of fixed-size blocks sized by a
memory budget (`kv_budget`), and a request holds only the blocks its tokens fill (`Paging` decides).
Each `step()`:
  1. decode rows whose next position starts a block get one; when the pool is short the youngest
     requests are preempted (their blocks freed, requeued first to re-prefill what they had);
  2. admit waiting requests into free slots (cache rows) while their prompts' blocks fit;
  3. pick up to `prefill_tokens` prompt tokens to prefill (pieces of prompts, FIFO: a long prompt
     never stalls the decode batch for more than one budget);
  4. one `Backend.forward` per version present runs its decode rows (one token each, over that
     version's contiguous rows; attention cut into chunks of similar length, see `chunks`) together
     with its prefill pieces, one pass over the weights; then one sampling call for the decode rows
     and one for the requests whose prompt completed (their first token; they join the decode batch
     next step);
  5. one device->host read (stop flags, skipped when no live request has stop tokens), then finished
     requests leave at once and the decode rows are compacted (`Slots`; a row move copies its block
     table row, not its k/v).
Lengths are known on the host without reading the device (every decoding request gains one token
per step), so the only other device reads are the outputs of requests that finish, are aborted or
are preempted.

A request ends with STOP on one of its `stop_token_ids` (the engine adds no EOS of its own), with
LENGTH at `max_new_tokens` (resumed tokens count) or when prompt + response fill `max_context` (a
response is cut there like at max_new_tokens; a prompt that leaves no room is refused by `add`).
Preemption changes no output: a preempted request resumes as an aborted one does (`abort_resume`).
With `keep_finished` (multi-turn: a request that stopped at a tool call continues after the tool
answers), a finished request's blocks stay, and a later request of the same version and adapter whose
prompt + resumed tokens extend its tokens adopts them and prefills only the rest: the k/v it reuses
are those its own uninterrupted decoding would have computed. Kept blocks count as free: the pool
takes them back, oldest first, before it refuses an admission or preempts anyone.
LoRA adapters (`load_adapter`) apply over any version: a request names one in `GenRequest.adapter`, and
each version's forward runs the base GEMMs over all its rows once and the rows' low-rank terms after
them, per row (`adapters`), so rows of several adapters (and of none) share a step.
Seeded requests are batch-invariant (see `sampler`): the same tokens alone or in any batch, up to
floating-point differences between batch shapes (a flip needs a near-tie of perturbed logits).

With `max_versions=1` the engine holds one version, as vLLM does (a large model: one copy of its
weights): a load of another version overwrites the held weights in place and relabels them, and is
refused while any request waits or runs.

Not thread-safe: call `add`, `abort`, `load_weights`, ... between steps, from the thread that steps.
The engine owns the model it is given (it may be overwritten by `load_weights(..., version=0)`, or by
any load with `max_versions=1`); it is copied only when `device`/`dtype` ask for a different placement.
"""

from __future__ import annotations

import copy
import random
import time
from collections import Counter, deque
from collections.abc import Callable

import torch

from tailrace.engine import backends, chunks, prefill
from tailrace.engine.adapters import Adapters
from tailrace.engine.admission import SlotBook, special
from tailrace.engine.errors import EngineError, check_request
from tailrace.engine.events import StepEvent
from tailrace.engine.held import HeldWeights
from tailrace.engine.kv_budget import GIB, size_pool
from tailrace.engine.kv_cache import KVCache
from tailrace.engine.paging import Paging
from tailrace.engine.rows import POS, TOK, RowState
from tailrace.engine.sampler import SampleFlags, sample, seed_key, vocab_salt
from tailrace.engine.sequence import Sequence
from tailrace.engine.slots import Slots
from tailrace.engine.spec import DRAFTERS, SpecOptions, SpecStats, Speculator
from tailrace.engine.spec.drafter import DraftEnv, Drafter, Trained
from tailrace.engine.speculative import Draft, SpeculativeSteps, Verified
from tailrace.engine.versions import Versions
from tailrace.model.decoder import CausalLM
from tailrace.model.moe import sparse_layers
from tailrace.types import Capabilities, Finish, GenRequest, GenResult, SamplingParams, queue_by_priority

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def capabilities(speculative: bool, max_versions: int | None = None) -> Capabilities:
    """What a `TailraceEngine` can do (the runtime asks before it builds one)."""
    return Capabilities(
        abort_resume=True,
        versions_at_once=max_versions,
        per_request_seed=True,
        speculative=speculative,
        adapters=True,
    )


class TailraceEngine(SpeculativeSteps, HeldWeights, SlotBook):
    """tailrace's own engine, in PyTorch (CPU and CUDA). Named for its implementer, as an adapter to
    another engine is named for that engine (`VLLMEngine`); both implement `Engine`."""

    def __init__(
        self,
        model: CausalLM,
        *,
        num_slots: int = 64,
        max_context: int | None = None,
        expected_context: int | None = None,
        kv_memory_gb: float | None = None,
        block_size: int = 16,
        prefill_tokens: int = 512,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        threads: int | None = None,
        attention: str | None = None,
        kv_dtype: torch.dtype | None = None,
        spec: str | Callable[[DraftEnv], Drafter] | SpecOptions | None = None,
        keep_finished: bool = False,
        max_versions: int | None = None,
        batch_invariant: bool | None = None,
        routes: bool = False,
    ):
        """`model` is version 0. `max_context`: context limit (prompt + response) per request, default
        the model's `context_limit` (or less, if the KV pool holds less; one past the model's sliding
        window is refused). `expected_context`: the most tokens a request of the work holds (its prompt
        and response limit): the pool is sized for `num_slots` of them (default max_context), within the
        budget. `kv_memory_gb`: the KV cache's budget in GiB, default a fraction of the memory available
        (see `kv_budget`);
        `block_size`: tokens per KV block. `threads`: torch intra-op threads (None leaves the caller's
        setting). `attention`: the step's backend, chosen once: 'auto' (None), 'kernel' (the CPU C
        kernels; 'auto' picks them on CPU with one thread), 'bmm' or 'sdpa' (the torch backend with
        that decode attention), see `backends.select`; `backend` names the one chosen. `kv_dtype`:
        the KV cache's dtype, default the model's (float32 with a bf16 model: fp32 cache, twice the
        bytes). `spec`: speculative decoding with this drafter (a name in `spec.DRAFTERS`, or a factory
        of a `Drafter`; None or 'off': none) or these `SpecOptions`; it changes no output, only the
        time (see `spec`). `keep_finished`: keep finished requests' k/v for continuations (see above;
        not with speculation, whose drafters keep caches of their own). `max_versions`: None, as many
        versions as are loaded; 1, one (see above). `batch_invariant`: a request's logits do not depend
        on the batch it shares (see `backends.select`; the torch backend in bf16 then attends in fp32 at
        every batch); default: with speculation only, whose verified tokens must come out as decoded
        ones would. Without it the torch backend's bf16 rows move with the batch size (~0.06 in a
        logprob: a token can change), so compare a speculating engine with one built batch-invariant.
        `routes`: a mixture of experts' results carry the experts each position's forward chose
        (`GenResult.routes`, for routing replay; model/moe.py)."""
        if max_versions not in (None, 1):
            raise EngineError(
                f"max_versions={max_versions}: use None (as many versions as are loaded) or 1 (one copy "
                "of the weights: a load of another version replaces the one held)"
            )
        if num_slots < 1:
            raise EngineError(f"num_slots={num_slots} must be at least 1")
        if prefill_tokens < 1:
            raise EngineError(f"prefill_tokens={prefill_tokens} must be at least 1")
        if threads is not None:
            torch.set_num_threads(threads)
        w = model.model.embed_tokens.weight
        device = torch.device(device) if device is not None else w.device
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise EngineError(f"dtype={dtype!r} is unknown; use one of {sorted(_DTYPES)}")
            dtype = _DTYPES[dtype]
        dtype = dtype or w.dtype
        if w.device != device or w.dtype != dtype:
            model = copy.deepcopy(model).to(device=device, dtype=dtype)
        cfg = model.config
        if max_context is not None and max_context < 2:
            raise EngineError(
                f"max_context={max_context} must be at least 2 (one prompt token and one new token)"
            )
        try:
            context = cfg.context(max_context)
        except ValueError as e:
            raise EngineError(str(e)) from None
        kv_dtype = kv_dtype or dtype
        self.kv_size = size_pool(
            token_bytes=KVCache.token_bytes(model, kv_dtype, routes and cfg.moe),
            block_size=block_size,
            num_slots=num_slots,
            max_context=context,
            context_given=max_context is not None,
            budget_gib=kv_memory_gb,
            device=device,
            expected_context=expected_context,
        )
        self.num_slots, self.prefill_tokens = num_slots, prefill_tokens
        self.max_context = self.kv_size.max_context
        self.device, self.dtype, self.vocab_size = device, dtype, cfg.vocab_size
        try:  # +1 row: the slots' swap row
            self.cache = KVCache.for_model(
                model, self.kv_size.num_blocks, block_size, num_slots + 1, self.max_context, kv_dtype, device
            )
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeError subclasses
            raise EngineError(
                f"allocating the KV cache ({self.kv_size.num_blocks * self.kv_size.block_bytes / GIB:.2f} GiB) "
                f"failed: {str(e).splitlines()[0]}; lower kv_memory_gb"
            ) from e
        if routes:
            if not cfg.moe:
                raise EngineError(
                    f"routes=True records a mixture of experts' routing; {cfg.model_type} has no experts"
                )
            self.cache.keep_routes(sparse_layers(cfg), cfg.num_experts_per_tok)
        # the backends address every position of a row's blocks (max_context rounded up to a block)
        opts = spec if isinstance(spec, SpecOptions) else SpecOptions(spec) if spec is not None else None
        speculating = opts is not None and opts.drafter != "off"
        if batch_invariant is None:  # verified tokens attend as prefill pieces, decoded ones as decode rows
            batch_invariant = speculating
        select = backends.select(attention, model, self.cache.max_context, kv_dtype, batch_invariant)
        self._versions = Versions(model, select)
        self._adapters = Adapters(cfg, dtype, device)
        self._per_adapter: Counter[str] = Counter()  # live requests per adapter name ("" = none)
        self.backend = self._versions[0].name
        self.paging = Paging(self.kv_size.num_blocks, block_size)
        self.rows = RowState(num_slots + 1, cfg.vocab_size, device)
        self.slots = Slots(num_slots)
        self._salt = vocab_salt(cfg.vocab_size, device)
        self._sample_kernel = self._versions[0].kernel  # the backend's CPU kernels, None where it has none
        self._rng = random.Random(seed)
        self._seqs: dict[str, Sequence] = {}  # every request in the engine (waiting or running)
        self._waiting: deque[Sequence] = deque()
        self._prefilling: list[Sequence] = []  # admission order
        self._done_next: list[GenResult] = []  # finished without compute, returned by the next step
        self._per_version: Counter[int] = Counter()
        self._decode_step = 0
        self._finish_at: dict[int, list[Sequence]] = {}  # decode step -> sequences reaching their length
        self._grow_at: dict[int, list[Sequence]] = {}  # decode step -> sequences starting a new block
        self._arrivals = 0  # requests added so far: the next one's age
        self.preemptions = 0  # requests preempted so far (each re-prefills once readmitted)
        self._sorting: dict[int, list] = {}  # version -> [steps since its rows were sorted, overhead then]
        self._n_sampled = self._n_tempered = self._n_filter = self._n_min_stop = self._n_stop = 0
        self._n_special = 0  # decode rows (of each kind; special: filtered or banning, see `sampler`)
        self._spec = None
        if speculating:
            make = DRAFTERS.get(opts.drafter) if isinstance(opts.drafter, str) else opts.drafter
            if make is None:
                raise EngineError(f"spec={opts.drafter!r} is unknown; use 'off' or one of {sorted(DRAFTERS)}")
            env = DraftEnv(
                self.cache,
                self.rows,
                self._salt,
                self._sample_kernel,
                select,
                lambda v: self._versions[v].model,
            )
            self._spec = Speculator(make(env), opts)
        self.capabilities = capabilities(speculative=self._spec is not None, max_versions=max_versions)
        if keep_finished and self._spec is not None:
            raise EngineError("keep_finished=True does not work with speculative decoding; drop one")
        self.keep_finished = keep_finished
        # (version, adapter, prompt ids) -> [(key of kept blocks, the tokens they hold k/v for + 1)]
        self._kept: dict[tuple, list[tuple[str, tuple[int, ...]]]] = {}
        self.reused_tokens = 0  # prompt + resumed tokens not prefilled again: their k/v were kept

    # -- public API ---------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.slots.num_used

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._done_next)

    @property
    def versions(self) -> tuple[int, ...]:
        return self._versions.ids

    def __contains__(self, request_id: str) -> bool:
        """Whether a request is waiting or running (so `abort` would succeed)."""
        return request_id in self._seqs

    def describe(self) -> str:
        return f"{self.backend} backend; {self.kv_size.describe(self.num_slots)}"

    def add(self, req: GenRequest) -> None:
        """Queue a request; raises `EngineError` (and changes nothing) if it is malformed."""
        check_request(req, self._seqs, self._versions, self.max_context, self.vocab_size, self._adapters)
        seed = req.params.seed if req.params.seed is not None else self._rng.getrandbits(64)
        seq = Sequence(req, seed_key(seed), time.perf_counter(), self.max_context, self._arrivals)
        self._arrivals += 1
        if seq.allowed <= 0:  # a resumed partial that already has max_new_tokens
            self._done_next.append(self._result(seq, [], [], Finish.LENGTH, seq.submitted))
            return
        self.rows.reserve(seq.num_resumed + seq.allowed)
        self._seqs[req.id] = seq
        self._per_version[req.version] += 1
        self._per_adapter[req.adapter] += 1
        queue_by_priority(self._waiting, seq, _priority)

    def abort(self, request_id: str) -> GenResult:
        """Take a waiting or running request out; returns its partial (finish=ABORTED)."""
        seq = self._live(request_id, "abort")
        with torch.inference_mode():
            new_toks, new_lps = self._tokens_so_far(seq)
            routes = self._routes(seq, new_toks)
            if request_id not in self.slots.row:
                self._waiting.remove(seq)
            elif not self.slots.is_decoding(request_id):
                self._prefilling.remove(seq)
            self._remove(seq)
        return self._result(seq, new_toks, new_lps, Finish.ABORTED, time.perf_counter(), routes)

    def peek(self, request_id: str) -> GenResult:
        """A waiting or running request's tokens so far, as `abort` would return them (finish=ABORTED),
        the request left running (a server streams them)."""
        seq = self._live(request_id, "peek")
        with torch.inference_mode():
            new_toks, new_lps = self._tokens_so_far(seq)
        return self._result(seq, new_toks, new_lps, Finish.ABORTED, time.perf_counter())

    def _live(self, request_id: str, call: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise EngineError(
                f"{call}({request_id!r}): no such request in the engine (finished, aborted "
                f"or never added); {call} only requests that are waiting or running"
            )
        return seq

    def _tokens_so_far(self, seq: Sequence) -> tuple[list[int], list[float]]:
        """The tokens (and logprobs) a decoding request drew since it was added (none before)."""
        if seq.id not in self.slots.row or not self.slots.is_decoding(seq.id):
            return [], []
        row, r0 = self.slots.row[seq.id], seq.num_resumed
        [(toks, lps)] = self.rows.outputs([row], [r0], [r0 + seq.num_new(self._decode_step)])
        return toks, lps

    def add_history(self, prompt_ids: tuple[int, ...], token_ids: tuple[int, ...]) -> None:
        """A response to `prompt_ids` that a history drafter may draft from (an earlier epoch's, or one
        pre-generated in idle time); the engine adds the responses it finishes itself. Ignored without
        speculation or by drafters that draft from weights."""
        if self._spec:
            self._spec.drafter.add_history(tuple(prompt_ids), tuple(token_ids))

    def idle(self, budget_s: float) -> Trained | None:
        """Time the caller gives while no request is waiting or running: a trained drafter learns
        for up to `budget_s` seconds, within its budget per idle period (`SpecOptions.train_s`; the
        next step starts a new period). None: nothing learnt (busy, no such drafter, or budget spent)."""
        if self._spec is None or self._seqs or self._done_next:
            return None
        return self._spec.idle(budget_s)

    @property
    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding's running books (None without speculation)."""
        return self._spec.stats if self._spec else None

    def generate(
        self, requests: list[GenRequest], on_done: Callable[[int, int], None] | None = None
    ) -> list[GenResult]:
        """Run `requests` to completion on an idle engine; results in request order. `on_done(done,
        total)` hears of progress after each step that finished requests."""
        if self._seqs or self._done_next:
            raise EngineError(
                "generate() needs an idle engine; step() until num_running and num_waiting are 0"
            )
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i, n in Counter(ids).items() if n > 1)
            raise EngineError(
                f"request id {dup!r} appears twice in generate(); give each request a unique id"
            )
        for r in requests:
            check_request(r, self._seqs, self._versions, self.max_context, self.vocab_size, self._adapters)
        for r in requests:
            self.add(r)
        results: dict[str, GenResult] = {}
        while len(results) < len(requests):
            finished = self.step().finished
            for res in finished:
                results[res.request_id] = res
            if finished and on_done is not None:
                on_done(len(results), len(requests))
        return [results[i] for i in ids]

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> StepEvent:
        t0 = time.perf_counter()
        with torch.inference_mode():
            self._grow()
            self._admit()
            pieces = prefill.plan(self._prefilling, self.prefill_tokens)
            plans = self._arrange()
            active = self.slots.num_decoding
            drafts, t_draft = self._draft(active) if self._spec is not None and active else ([], 0.0)
            advanced = tuple(self.slots.owner[:active]) + tuple(p.seq.id for p in pieces)
            completed, pre_stop, dec_stop, drafts, draft_logits = self._forward(pieces, plans, drafts)
            stops = self._stop_flags(completed, pre_stop, dec_stop)
            if drafts:  # the stop flags come back with the verify's tokens, in one read
                v = self._verify(drafts, draft_logits, len(completed), stops)
                stopped = v.stopped
            else:
                v, stopped = Verified(), _read(stops)
            finished = self._settle(completed, stopped, active)
        duration = time.perf_counter() - t0
        if self._spec is not None:
            if active and not pieces:  # the toggle's cost model: decode and verify steps
                toggle, emitted = self._spec.toggle, active + v.extra
                toggle.observe_step(active, v.drafted, len(drafts), duration - t_draft, t_draft, emitted)
            self._spec.step(active, len(drafts), active + v.extra)
        return StepEvent(
            t0,
            duration,
            active,
            sum(p.n for p in pieces),
            active + v.extra + len(completed),
            advanced,
            finished,
            drafted=v.drafted,
            accepted=v.accepted,
            verifies=len(drafts),
            by_version=tuple((ver, d, a) for ver, (d, a) in sorted(v.by_version.items())),
            by_adapter=tuple((name, d, a) for name, (d, a) in sorted(v.by_adapter.items())),
        )

    def _arrange(self) -> list[list[chunks.Chunk]]:
        """Per decode group: attention chunks of its rows; re-sorts the group's rows (longest first)
        when they have drifted far enough out of order that chunking loses (see `chunks`)."""
        plans = []
        for g in self.slots.groups:
            step = self._decode_step
            positions = [self._seqs[r].pos_key + step for r in self.slots.owner[g.start : g.stop]]
            plan = chunks.plan(positions)
            ratio = chunks.overhead(positions, plan)
            st = self._sorting.setdefault(g.version, [0, 1.0])  # steps since sort, overhead after it
            st[0] += 1
            if chunks.needs_sort(ratio, st[1], st[0]):
                order = sorted(self.slots.owner[g.start : g.stop], key=lambda r: -self._seqs[r].pos_key)
                self._apply(self.slots.reorder(g.version, order))
                positions = [self._seqs[r].pos_key + step for r in order]
                plan = chunks.plan(positions)
                st[0], st[1] = 0, chunks.overhead(positions, plan)
            plans.append(plan)
        return plans

    def _forward(self, pieces: list[prefill.Piece], plans: list[list[chunks.Chunk]], drafts: list[Draft]):
        """One backend call per version present: its decode rows, its rows' drafts and its prefill
        pieces together (one pass over the weights). Samples every decode row and the first token of
        each request whose prompt completes. Returns (those requests, their stop flags, the decode
        rows' stop flags, the drafts in the order of their logits, those logits)."""
        plan_of = {g.version: (g, plan) for g, plan in zip(self.slots.groups, plans)}
        by_version: dict[int, list[prefill.Piece]] = {}
        for p in pieces:
            by_version.setdefault(p.seq.version, []).append(p)
        drafts_of: dict[int, list[Draft]] = {}
        for d in drafts:
            drafts_of.setdefault(d.seq.version, []).append(d)
        dec_logits, draft_logits, first_logits, completed, ordered = [], [], [], [], []
        for v in [g.version for g in self.slots.groups] + [v for v in by_version if v not in plan_of]:
            g, plan = plan_of.get(v, (None, []))
            rows = slice(g.start, g.stop) if g else slice(0, 0)
            B = rows.stop - rows.start
            ds = drafts_of.get(v, [])
            nd = sum(len(d.tokens) for d in ds)
            lora = self._lora_step(rows, ds, by_version.get(v, []))
            tokens, positions, spans, want = self._inputs(rows, ds, by_version.get(v, []), completed)
            logits = self._versions[v].forward(tokens, positions, self.cache, rows, plan, spans, want, lora)
            if B:
                dec_logits.append(logits[:B])
            if nd:
                draft_logits.append(logits[B : B + nd])
                ordered += ds
            if logits.shape[0] > B + nd:
                first_logits.append(logits[B + nd :])
        dec_stop = self._sample_decode(_cat(dec_logits)) if dec_logits else None
        pre_stop = self._sample_first(_cat(first_logits), completed) if completed else None
        return completed, pre_stop, dec_stop, ordered, _cat(draft_logits) if draft_logits else None

    def _lora_step(self, rows: slice, drafts: list[Draft], pieces: list[prefill.Piece]):
        """The adapters of one version's forward, token by token in `_inputs`' order (None: none)."""
        if self._per_adapter[""] == len(self._seqs):  # no live request names an adapter
            return None
        slot, seqs = self._adapters.slot, self._seqs
        slots = [slot(seqs[r].req.adapter) for r in self.slots.owner[rows]]
        for d in drafts:
            slots += [slot(d.seq.req.adapter)] * len(d.tokens)
        for p in pieces:
            slots += [slot(p.seq.req.adapter)] * p.n
        return self._adapters.step(slots)

    def _inputs(
        self, rows: slice, drafts: list[Draft], pieces: list[prefill.Piece], completed: list[Sequence]
    ):
        """Tokens and positions of one version's forward: its decode rows, its rows' drafts (each at
        the positions after its row's), then its prefill pieces; the drafts' and pieces' (row, start,
        n); which outputs need logits (None: the decode rows only). Requests whose prompt completes
        are appended to `completed`."""
        ints, dev = self.rows.ints, self.device
        tokens, positions = ints[rows, TOK], ints[rows, POS]
        if not pieces and not drafts:
            return tokens, positions, [], None
        kept = rows.stop - rows.start + sum(len(d.tokens) for d in drafts)  # outputs with logits
        ids = [t for d in drafts for t in d.tokens]
        ids += [t for p in pieces for t in p.seq.ids[p.start : p.start + p.n]]
        pos = [i for d in drafts for i in range(d.pos + 1, d.pos + 1 + len(d.tokens))]
        pos += [i for p in pieces for i in range(p.start, p.start + p.n)]
        tokens = torch.cat((tokens, torch.tensor(ids).to(dev, non_blocking=True)))
        positions = torch.cat((positions, torch.tensor(pos).to(dev, non_blocking=True)))
        spans = [(d.row, d.pos + 1, len(d.tokens)) for d in drafts]
        spans += [(self.slots.row[p.seq.id], p.start, p.n) for p in pieces]
        last, off = [], kept
        for p in pieces:
            off += p.n
            p.seq.prefilled += p.n
            if p.completes:
                last.append(off - 1)
                completed.append(p.seq)
        if not last and not drafts:
            return tokens, positions, spans, None
        want = torch.tensor(list(range(kept)) + last).to(dev, non_blocking=True)
        return tokens, positions, spans, want

    def _sample_decode(self, logits: torch.Tensor) -> torch.Tensor:
        """Sample the next token of every decode row [0, n); returns their stop flags."""
        n = logits.shape[0]
        flags = SampleFlags(
            any_sampled=self._n_sampled > 0,
            any_greedy=self._n_sampled < n,
            any_tempered=self._n_tempered > 0,
            any_filter=self._n_filter > 0,
            any_min_new=self._n_min_stop > 0,
            any_plain=self._n_special < n,
        )
        tokens, lps = sample(
            logits,
            salt=self._salt,
            flags=flags,
            kernel=self._sample_kernel,
            **self.rows.sampling_args(slice(0, n)),
        )
        self._decode_step += 1
        return self.rows.record(slice(0, n), tokens, lps, advance_pos=True)

    def _sample_first(self, logits: torch.Tensor, completed: list[Sequence]) -> torch.Tensor:
        """Sample the first new token of each request whose prompt completed; returns their stop flags."""
        rows_t = torch.tensor([self.slots.row[s.id] for s in completed]).to(self.device, non_blocking=True)
        flags = self._flags([s.req.params for s in completed])
        tokens, lps = sample(
            logits,
            salt=self._salt,
            flags=flags,
            kernel=self._sample_kernel,
            **self.rows.sampling_args(rows_t),
        )
        for s in completed:
            self._prefilling.remove(s)
        return self.rows.record(rows_t, tokens, lps, advance_pos=False)

    def _flags(self, ps: list[SamplingParams]) -> SampleFlags:
        """The sampler's flags for rows with these parameters."""
        return SampleFlags(
            any_sampled=any(p.temperature > 0 for p in ps),
            any_greedy=any(p.temperature == 0 for p in ps),
            any_tempered=any(p.temperature not in (0, 1) for p in ps),
            any_filter=any(p.top_k or p.top_p < 1 for p in ps),
            any_min_new=any(p.min_new_tokens and p.stop_token_ids for p in ps),
            any_plain=not all(special(p, self.vocab_size) for p in ps),
        )

    def _stop_flags(self, completed: list[Sequence], pre_stop, dec_stop) -> torch.Tensor | None:
        """Which rows sampled a stop token (prefill-completed requests first, then decode rows), on the
        device; None when no request involved has stop tokens (rows without them never flag, so the
        parts can be read together). Reading them is the one device->host read of a step (`_read`, or
        with a verify's tokens)."""
        need = (dec_stop is not None and self._n_stop > 0) or any(
            s.req.params.stop_token_ids for s in completed
        )
        if not need:
            return None
        return _cat([t for t in (pre_stop, dec_stop) if t is not None])

    def _settle(self, completed: list[Sequence], stopped: list[int], active: int) -> tuple[GenResult, ...]:
        """Host bookkeeping after the step: finish requests, move prefilled ones into the decode batch."""
        now = time.perf_counter()
        nc = len(completed)
        fin: list[tuple[Sequence, Finish]] = []
        stop_ids = set()
        for i in stopped:
            seq = completed[i] if i < nc else self._seqs[self.slots.owner[i - nc]]
            fin.append((seq, Finish.STOP))
            stop_ids.add(seq.id)
        if active:
            for seq in self._finish_at.pop(self._decode_step, ()):
                if (
                    self._seqs.get(seq.id) is seq
                    and seq.finish_step == self._decode_step
                    and seq.id not in stop_ids
                ):
                    fin.append((seq, Finish.LENGTH))
        for seq in completed:
            seq.first_token, seq.new_at_join = seq.first_token or now, 1  # a preempted one keeps its own
            if seq.allowed == 1 and seq.id not in stop_ids:
                fin.append((seq, Finish.LENGTH))
        results = self._done_next
        self._done_next = []
        if fin:
            step = self._decode_step
            outs = self.rows.outputs(
                [self.slots.row[s.id] for s, _ in fin],
                [s.num_resumed for s, _ in fin],
                [s.num_resumed + s.num_new(step) for s, _ in fin],
            )
            for (seq, reason), (toks, lps) in zip(fin, outs):
                res = self._result(seq, toks, lps, reason, now, self._routes(seq, toks))
                results.append(res)
                if self.keep_finished and self.paging.holds(seq.id):  # k/v of all but its last token
                    full = seq.ids + tuple(toks)
                    key = self.paging.keep(seq.id, len(full) - 1)
                    self._kept.setdefault((seq.version, seq.req.adapter, seq.req.prompt_ids), []).append(
                        (key, full)
                    )
                self._remove(seq)
                if self._spec is not None:  # a sibling's response: what the others may draft from
                    self._spec.drafter.add_history(seq.req.prompt_ids, res.token_ids)
        for seq in completed:
            if seq.id in self._seqs:
                self._join(seq)
        return tuple(results)

    # -- bookkeeping --------------------------------------------------------------------------------

    def _routes(self, seq: Sequence, toks: list[int]) -> bytes:
        """The routes of a request's positions but its last token's (none fed yet), or b"": none kept, or
        its prompt not all in the cache (waiting, preempted, prefilling). A resumed request's positions
        before its resumed tokens' last are its `resume_routes` (the experts chosen when each next token
        was drawn, maybe under an older version), the rest this request's own."""
        if self.cache.routes is None or seq.id not in self.slots.row or seq.to_prefill:
            return b""
        fresh = self.cache.read_routes(self.slots.row[seq.id], len(seq.ids) + len(toks) - 1)
        before = seq.req.resume_routes  # the positions whose next token an earlier request drew
        return before + fresh[len(before) :] if len(before) <= len(fresh) else fresh

    def _result(
        self, seq: Sequence, toks: list[int], lps: list[float], finish: Finish, t: float, routes: bytes = b""
    ) -> GenResult:
        r = seq.req
        return GenResult(
            request_id=r.id,
            token_ids=r.resume_ids + tuple(toks),
            logprobs=r.resume_logprobs + tuple(lps),
            versions=r.resume_versions + (r.version,) * len(toks),
            finish=finish,
            submitted=seq.submitted,
            first_token=seq.first_token,
            finished=t,
            routes=routes,
        )


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _read(flags: torch.Tensor | None) -> list[int]:
    """The indices of the flags set (a device->host read; none when there are no flags)."""
    return [] if flags is None else torch.nonzero(flags).flatten().tolist()


def _priority(seq: Sequence) -> tuple:
    return seq.req.priority
