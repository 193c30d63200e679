"""`VLLMEngine`: the `Engine` protocol over vLLM's Python API (`vllm.LLMEngine`, the v1 engine core).

Only this module imports vLLM, and only when an engine is built (`pip install 'tailrace[vllm]'`, or
`make vllm` for the CPU build). Token ids in, token ids out: vLLM runs without a tokenizer.

How the protocol maps onto vLLM:
  * `add`: `LLMEngine.add_request` with the prompt's ids, n=1, DELTA outputs (a step returns only the
    new tokens), the sampled token's logprob (`logprobs=0`) under `logprobs_mode="processed_logprobs"`:
    the distribution sampled from, after temperature and the top-k / top-p filter (a greedy row: the
    untempered softmax), as tailrace's own sampler defines it (`sampler`);
  * `step`: one `LLMEngine.step()`, one iteration of vLLM's scheduler: at most `prefill_tokens` tokens
    (`max_num_batched_tokens`) over at most `num_slots` sequences;
  * `abort`: `abort_request`; the partial is what earlier steps returned;
  * `load_weights`: the worker's in-place reload (`collective_rpc("reload_weights")`) from the state
    dict as it is: tailrace's parameter names are HF checkpoint names, and vLLM's model packs q/k/v
    and gate/up itself; the prefix cache is then reset (its k/v were computed by the old weights).

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in-process; on CPU the
uniproc executor), so a step is a function call and weights pass by reference. VLLM_CPU_OMP_THREADS_BIND
defaults to nobind: the caller places threads (the runtime pins each engine process to its cores).

What it cannot do (`CAPABILITIES`):
  * one version at a time: vLLM holds one set of weights. `load_weights` of another version replaces
    it, and every load waits for an idle engine (refused while a request waits or runs);
  * abort_resume: a request carrying a partial (`resume_*`) continues from prompt + partial as its new
    prompt with the rest of its budget: a valid continuation, not the tokens the uninterrupted request
    would have drawn (vLLM's per-request generator starts afresh; the seed is mixed with the resumed
    length, so the continuation does not reuse the noise that drew the partial's first tokens);
  * no speculative decoding;
  * on CPU, a mixture of experts' weights are fixed: vLLM 0.32's CPU build reloads its experts wrongly and
    has no MoE LoRA without Triton, so `load_weights` and `lora_rank` are refused there; an OLMoE that
    vLLM's class would serve as another model (eps or renormalizing) is refused at build.
With `lora_rank`, it serves LoRA adapters (`load_adapter`, `GenRequest.adapter`; `capabilities.adapters`)
through vLLM's own LoRA support (`vllm_lora`): rows of up to `max_adapters` adapters share one step's
forward, the base GEMMs once. A LoRA run's versions are adapters over the one base (`adapter_versions`),
so such an engine holds as many versions as the run needs.
Chunked prefill is off: vLLM 0.32 on CPU crashes on a seeded request whose prompt a step splits
(`torch.Generator.set_offset` is CUDA-only), so a step's token budget is at least `max_context` and a
prompt is prefilled whole, in the step that samples its first token. A request counts as waiting until
that first token arrives.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tailrace.engine.errors import EngineError, check_request
from tailrace.engine.events import StepEvent
from tailrace.engine.vllm_lora import VLLMAdapters, slot_rank
from tailrace.model import fused
from tailrace.model.checkpoint import read_config
from tailrace.model.lora import Adapter
from tailrace.model.moe import to_disk
from tailrace.types import Capabilities, Finish, GenRequest, GenResult

CAPABILITIES = Capabilities(
    abort_resume=False, versions_at_once=1, per_request_seed=True, speculative=False, adapters=False
)
INSTALL = "pip install 'tailrace[vllm]' (or `make vllm`: vLLM's CPU build in .venv-vllm)"
_ENV = {  # defaults; VLLM_ENABLE_V1_MULTIPROCESSING=0 is set always (steps and loads assume it)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # the caller pins threads
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",  # a local checkpoint; nothing is fetched
}
_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH}
_SEED_MASK = (1 << 63) - 1


def vllm_available() -> str | None:
    """None when vLLM can be imported, else one line naming the problem and the fix."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"rollout.backend=vllm needs vLLM, which does not import here ({e}); {INSTALL}"
    return torchvision_problem()


def torchvision_problem() -> str | None:
    """vllm-cpu requires torchvision, torchaudio and torchcodec, and pip takes PyPI's builds, made for
    another torch: vLLM imports, then its model loader fails on `torchvision::nms`. vLLM on CPU needs
    none of them. One line naming the fix where torchvision is installed and does not load."""
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except (RuntimeError, ImportError, OSError) as e:
        return (
            f"torchvision does not load beside torch {torch.__version__} ({str(e).splitlines()[0]}); vLLM "
            "installs it but does not need it on CPU: pip uninstall -y torchvision torchaudio torchcodec"
        )
    return None


@dataclass
class _Live:
    req: GenRequest
    submitted: float
    first_token: float = 0.0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    lora: object = None  # the vLLM LoRARequest it runs with (None: the base)


class VLLMEngine:
    """vLLM serving the checkpoint directory `model_path` (config.json + safetensors) as version 0."""

    capabilities = CAPABILITIES

    def __init__(
        self,
        model_path: str,
        *,
        num_slots: int = 64,
        max_context: int | None = None,
        kv_memory_gb: float | None = None,
        prefill_tokens: int = 512,
        dtype: str = "float32",
        seed: int = 0,
        threads: int | None = None,
        prefix_caching: bool = True,
        lora_rank: int = 0,
        max_adapters: int = 4,
    ):
        """`max_context`: tokens per request, prompt + response (default the model's limit);
        `kv_memory_gb`: vLLM's KV cache in GiB (default 1: vLLM's own default on CPU reserves a share of
        all memory); `prefill_tokens`: tokens per step (vLLM's max_num_batched_tokens; raised to
        `max_context`, see above); `threads`: torch threads (None leaves the caller's); `prefix_caching`: requests
        sharing a prompt (a group's samples) share its k/v; `lora_rank`: serve LoRA adapters up to this
        rank (0: none), rows of up to `max_adapters` of them in one step."""
        missing = vllm_available()
        if missing:
            raise EngineError(missing)
        if num_slots < 1 or prefill_tokens < 1 or max_adapters < 1:
            raise EngineError(
                f"num_slots={num_slots}, prefill_tokens={prefill_tokens}, max_adapters={max_adapters}: "
                "each must be >= 1"
            )
        cfg = read_config(model_path)
        # a fused family's adapters (Phi-3's) reach vLLM block-diagonal, their rank widened (model/fused.py)
        wide = lora_rank * fused.rank_factor(cfg)
        lora = (
            dict(enable_lora=True, max_loras=max_adapters, max_lora_rank=slot_rank(wide)) if lora_rank else {}
        )
        for k, v in _ENV.items():
            os.environ.setdefault(k, v)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and model in this process
        if threads is not None:
            torch.set_num_threads(threads)
        from vllm import EngineArgs, LLMEngine

        _check_head_size(cfg.head_dim)
        from vllm.platforms import current_platform

        # vLLM 0.32's CPU build reloads a mixture-of-experts layer wrongly (reloading the very weights it
        # serves changes its outputs: its experts are prepacked for the CPU kernel) and runs LoRA over
        # one with a Triton kernel the CPU lacks: there it serves an MoE model's fixed weights only
        self._reload_broken = cfg.moe and current_platform.is_cpu()
        if cfg.model_type == "olmoe" and (cfg.norm_topk_prob or cfg.rms_norm_eps != 1e-5):
            raise EngineError(
                f"vLLM's OLMoE class fixes rms_norm_eps at 1e-5 and never renormalizes its experts' weights; this "
                f"model has rms_norm_eps={cfg.rms_norm_eps} and norm_topk_prob={cfg.norm_topk_prob}, which vLLM "
                "would serve as another model: use --rollout.backend=tailrace"
            )
        if cfg.model_type == "qwen2_moe" and not cfg.attention_bias:
            raise EngineError(
                "vLLM's Qwen2-MoE class always has q/k/v biases; this model has none (qkv_bias false), which vLLM "
                "would serve as another model: use --rollout.backend=tailrace"
            )
        if self._reload_broken and lora_rank:
            raise EngineError(
                "vLLM's CPU build cannot serve LoRA adapters on a mixture-of-experts model (its MoE LoRA "
                "kernel needs Triton); use --rollout.backend=tailrace"
            )
        try:  # held to LongRoPE's short range (vLLM and the trainer attend to a sliding window alike)
            max_context = cfg.context(max_context)
        except ValueError as e:
            raise EngineError(str(e)) from None
        budget = max(prefill_tokens, num_slots, max_context)

        set_threads = torch.set_num_threads  # vLLM's CPU worker turns it into a no-op; give it back
        try:
            args = EngineArgs(
                model=str(model_path),
                skip_tokenizer_init=True,
                dtype=dtype,
                seed=seed,
                max_model_len=max_context,
                max_num_seqs=num_slots,
                max_num_batched_tokens=budget,
                enable_chunked_prefill=False,
                enable_prefix_caching=prefix_caching,
                enforce_eager=True,  # no torch.compile: start-up in seconds, not minutes
                logprobs_mode="processed_logprobs",
                kv_cache_memory_bytes=int((kv_memory_gb or 1.0) * 2**30),
                **lora,
            )
            self._llm = LLMEngine.from_engine_args(args)
        except (ValueError, RuntimeError, OSError) as e:
            raise EngineError(f"vLLM could not start on {model_path}: {str(e).splitlines()[0]}") from e
        finally:
            torch.set_num_threads = set_threads
        mc = self._llm.model_config
        self.num_slots, self.prefill_tokens, self.dtype = num_slots, budget, dtype
        self.max_context, self.vocab_size = mc.max_model_len, mc.get_vocab_size()
        self.kv_memory_gb = kv_memory_gb or 1.0
        # vLLM's Gemma 2 class refuses a tied lm_head (its embedding; the other classes want both)
        self._no_lm_head = cfg.tie_word_embeddings and cfg.model_type == "gemma2"
        self._cfg = cfg
        self._version = 0
        self._rng = random.Random(seed)
        self._live: dict[str, _Live] = {}
        self._done_next: list[GenResult] = []  # finished without compute, returned by the next step
        self._adapters = (
            VLLMAdapters(self._llm, lora["max_lora_rank"], max_adapters, cfg) if lora_rank else None
        )
        if lora_rank:
            self.capabilities = dataclasses.replace(CAPABILITIES, adapters=True)

    # -- what it holds ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return sum(1 for s in self._live.values() if s.tokens)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self._live.values() if not s.tokens) + len(self._done_next)

    @property
    def versions(self) -> tuple[int, ...]:
        return (self._version,)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def describe(self) -> str:
        import vllm

        lora = (
            f"; LoRA up to rank {self._adapters.max_rank}, {self._adapters.per_step} adapters a step"
            if self._adapters
            else ""
        )
        return (
            f"vLLM {vllm.__version__}; {self.dtype}; {self.num_slots} slots, max_context {self.max_context}, "
            f"KV cache {self.kv_memory_gb:g} GiB{lora}"
        )

    @property
    def adapters(self) -> tuple[str, ...]:
        return self._adapters.names if self._adapters else ()

    def load_adapter(self, name: str, adapter: Adapter) -> None:
        """Add a LoRA adapter of the base model under `name`, or replace the weights of the one held
        under it: requests of it already waiting or running finish on the weights they started with."""
        if self._adapters is None:
            raise EngineError(
                "load_adapter: this vLLM engine serves no adapters; build it with lora_rank > 0"
            )
        self._adapters.load(name, adapter)

    def drop_adapter(self, name: str) -> None:
        if self._adapters is None:
            raise EngineError(f"drop_adapter({name!r}): this vLLM engine serves no adapters")
        self._adapters.drop(name)

    # -- requests -----------------------------------------------------------------------------------

    def add(self, req: GenRequest) -> None:
        """Queue a request; raises `EngineError` (and changes nothing) if it is malformed."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        check_request(req, self._live, self.versions, self.max_context, self.vocab_size, self.adapters)
        p, n_res = req.params, len(req.resume_ids)
        now = time.perf_counter()
        allowed = p.max_new_tokens - n_res
        if allowed <= 0:  # a resumed partial that already has max_new_tokens
            self._done_next.append(_result(_Live(req, now), Finish.LENGTH, now))
            return
        seed = p.seed if p.seed is not None else self._rng.getrandbits(63)
        params = VSamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            max_tokens=allowed,
            min_tokens=max(0, p.min_new_tokens - n_res),
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=True,  # the request's stop_token_ids are its only stops, as in tailrace's engine
            seed=(seed ^ (n_res * 0x9E3779B97F4A7C15)) & _SEED_MASK,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_ids + req.resume_ids))
        lora = self._adapters.take(req.adapter) if self._adapters else None
        self._llm.add_request(req.id, prompt, params, lora_request=lora)
        self._live[req.id] = _Live(req, now, lora=lora)

    def step(self) -> StepEvent:
        t0 = time.perf_counter()
        outputs = self._llm.step() if self._live else []
        now = time.perf_counter()
        finished, self._done_next = self._done_next, []
        advanced, active, prefill, decoded = [], 0, 0, 0
        for out in outputs:
            s = self._live.get(out.request_id)
            if s is None:  # an aborted request's last output
                continue
            c = out.outputs[0]
            if c.token_ids:
                if s.tokens:
                    active += 1
                else:
                    s.first_token = now
                    prefill += len(s.req.prompt_ids) + len(s.req.resume_ids)
                advanced.append(s.req.id)
                decoded += len(c.token_ids)
                s.tokens += c.token_ids
                s.logprobs += [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
            if out.finished:
                del self._live[out.request_id]
                self._release(s)
                finished.append(_result(s, _FINISH.get(c.finish_reason, Finish.LENGTH), now))
        return StepEvent(t0, now - t0, active, prefill, decoded, tuple(advanced), tuple(finished))

    def abort(self, request_id: str) -> GenResult:
        """Take a waiting or running request out; returns its partial (finish=ABORTED)."""
        s = self._live.pop(request_id, None)
        if s is None:
            raise EngineError(
                f"abort({request_id!r}): no such request in the engine (finished, aborted "
                "or never added); abort only requests that are waiting or running"
            )
        self._llm.abort_request([request_id])
        self._release(s)
        return _result(s, Finish.ABORTED, time.perf_counter())

    def _release(self, s: _Live) -> None:
        if self._adapters is not None:
            self._adapters.release(s.lora)

    def peek(self, request_id: str) -> GenResult:
        """A waiting or running request's tokens so far (finish=ABORTED), the request left running."""
        s = self._live.get(request_id)
        if s is None:
            raise EngineError(
                f"peek({request_id!r}): no such request in the engine (finished, aborted "
                "or never added); peek only requests that are waiting or running"
            )
        return _result(s, Finish.ABORTED, time.perf_counter())

    def generate(
        self, requests: list[GenRequest], on_done: Callable[[int, int], None] | None = None
    ) -> list[GenResult]:
        """Run `requests` to completion on an idle engine; results in request order."""
        if self._live or self._done_next:
            raise EngineError(
                "generate() needs an idle engine; step() until num_running and num_waiting are 0"
            )
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise EngineError("generate() got a request id twice; give each request a unique id")
        for r in requests:
            check_request(r, (), self.versions, self.max_context, self.vocab_size, self.adapters)
        for r in requests:
            self.add(r)
        results: dict[str, GenResult] = {}
        while len(results) < len(requests):
            done = self.step().finished
            results.update((r.request_id, r) for r in done)
            if done and on_done is not None:
                on_done(len(results), len(requests))
        return [results[i] for i in ids]

    # -- weights ------------------------------------------------------------------------------------

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights by `state_dict` as `version` (the one held, or a new one replacing it);
        the engine must be idle: vLLM holds one version, and its cached prefixes go with it."""
        if self._live:
            raise EngineError(
                f"load_weights(version={version}): {len(self._live)} request(s) of version "
                f"{self._version} are waiting or running, and vLLM holds one version at a time; "
                "let them finish or abort them first"
            )
        if self._reload_broken:
            raise EngineError(
                f"load_weights(version={version}): vLLM's CPU build cannot reload a mixture-of-experts model's "
                "weights (reloading the same weights changes its outputs); use --rollout.backend=tailrace"
            )
        state_dict = to_disk(state_dict, self._cfg)  # vLLM's classes take the checkpoints' names (Mixtral's)
        weights = [(k, t) for k, t in state_dict.items() if not (self._no_lm_head and k == "lm_head.weight")]
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not self._llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset its prefix cache after a weight load; report this")
        self._version = version

    def drop_version(self, version: int) -> None:
        if version != self._version:
            raise EngineError(f"drop_version({version}): version not loaded; loaded: {self.versions}")
        raise EngineError(
            f"drop_version({version}): it is the only version (vLLM holds one); load another one instead"
        )

    def add_history(self, prompt_ids: tuple[int, ...], token_ids: tuple[int, ...]) -> None:
        """No speculative decoding here: nothing drafts from history."""

    def idle(self, budget_s: float) -> None:
        """No drafter to train in idle time."""
        return None


def _check_head_size(head_dim: int) -> None:
    """vLLM's CPU attention takes a fixed set of head sizes; another fails only at the first step."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise EngineError(
            f"the model's attention head size is {head_dim}, and vLLM's CPU attention takes only "
            f"{', '.join(map(str, sizes))}; use rollout.backend=tailrace (or a model with such heads)"
        )


def _result(s: _Live, finish: Finish, t: float) -> GenResult:
    r = s.req
    return GenResult(
        request_id=r.id,
        token_ids=r.resume_ids + tuple(s.tokens),
        logprobs=r.resume_logprobs + tuple(s.logprobs),
        versions=r.resume_versions + (r.version,) * len(s.tokens),
        finish=finish,
        submitted=s.submitted,
        first_token=s.first_token,
        finished=t,
    )
