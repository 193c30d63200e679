"""`VLLMEngine` through the `Engine` protocol, on tiny tailrace-written Llama (and Qwen3) checkpoints,
against tailrace's own engine and the model's own logits. Needs vLLM: skipped where it does not import (CI);
`make test-vllm` runs it with .venv-vllm's interpreter."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("vllm")

from tailrace.engine import Capabilities, Engine, EngineError, TailraceEngine, build_engine  # noqa: E402
from tailrace.model.checkpoint import load_pretrained, save_pretrained  # noqa: E402
from tailrace.types import Finish, GenRequest, SamplingParams  # noqa: E402
from tests.engine.engine_helpers import prompt, tiny_model  # noqa: E402

# vLLM's CPU attention takes head sizes in multiples of 32: hidden 64 over 2 heads
SHAPE = dict(num_attention_heads=2, num_key_value_heads=1)
SLOTS, CONTEXT = 4, 128  # sequences per vLLM step; tokens per request, and per step (no chunked prefill)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two checkpoints of one shape, different weights: versions 0 and 1."""
    root = tmp_path_factory.mktemp("vllm")
    paths = []
    for seed in (0, 1):
        save_pretrained(tiny_model(seed=seed, **SHAPE), root / f"w{seed}")
        paths.append(root / f"w{seed}")
    return paths


def _vllm(path, **kw) -> Engine:
    opts = dict(num_slots=SLOTS, prefill_tokens=16, max_context=CONTEXT, kv_memory_gb=0.0625, threads=1)
    return build_engine(path, backend="vllm", **{**opts, **kw})


@pytest.fixture(scope="module")
def eng(ckpts):
    return _vllm(ckpts[0])


def _req(rid, n_prompt=6, max_new=12, **params) -> GenRequest:
    seed = sum(map(ord, rid))
    return GenRequest(rid, prompt(seed, n_prompt), SamplingParams(max_new_tokens=max_new, **params))


def test_states_its_capabilities_and_refuses_what_it_cannot(eng):
    assert isinstance(eng, Engine)
    assert eng.capabilities == Capabilities(
        abort_resume=False, versions_at_once=1, per_request_seed=True, speculative=False, adapters=False
    )
    assert eng.versions == (0,)
    with pytest.raises(EngineError, match="not loaded"):
        eng.add(GenRequest("v1", (1, 2), SamplingParams(), version=1))
    with pytest.raises(EngineError, match="only version"):
        eng.drop_version(0)
    with pytest.raises(EngineError, match="no such request"):
        eng.abort("nobody")


def test_greedy_matches_tailraces_engine_token_for_token(eng, ckpts):
    reqs = [_req(f"g{i}", 3 + 2 * i, 10 + i, temperature=0.0) for i in range(6)]
    ours = TailraceEngine(load_pretrained(ckpts[0]), num_slots=SLOTS).generate(reqs)
    theirs = eng.generate(reqs)
    for a, b in zip(theirs, ours):
        assert a.token_ids == b.token_ids and a.finish == b.finish == Finish.LENGTH
        assert a.versions == (0,) * len(a.token_ids)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_seeded_tokens_do_not_depend_on_the_batch(eng):
    alone = eng.generate([_req("s", seed=7)])[0]
    crowd = [_req(f"c{i}", 4 + i, 16, seed=i) for i in range(5)]
    batched = {r.request_id: r for r in eng.generate(crowd + [_req("s", seed=7)])}
    assert batched["s"].token_ids == alone.token_ids
    other = eng.generate([_req("s", seed=8)])[0]
    assert other.token_ids != alone.token_ids


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 20)])
def test_logprobs_are_those_of_the_processed_distribution(eng, ckpts, temperature, top_p, top_k):
    """Each sampled token's logprob is log_softmax(logits / T) restricted to the top-k / top-p set and
    renormalized, recomputed here from a full forward of the model on prompt + response."""
    model = load_pretrained(ckpts[0])
    reqs = [_req(f"p{i}", 5, 16, temperature=temperature, top_p=top_p, top_k=top_k, seed=i) for i in range(4)]
    for req, res in zip(reqs, eng.generate(reqs)):
        ids = torch.tensor([req.prompt_ids + res.token_ids])
        with torch.no_grad():
            logits = model(ids)[0, len(req.prompt_ids) - 1 : -1].float() / temperature
        want = _filtered_logprobs(logits, top_p, top_k).gather(1, torch.tensor(res.token_ids)[:, None])
        got = torch.tensor(res.logprobs)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want.squeeze(1), atol=1e-4, rtol=0)


def test_a_greedy_rows_logprob_is_the_untempered_softmax_beside_sampled_rows(eng, ckpts):
    """tailrace's sampler's definition for temperature 0, in a batch that also samples at T = 0.7."""
    model = load_pretrained(ckpts[0])
    greedy = _req("gr", 5, 12, temperature=0.0)
    batch = [greedy] + [_req(f"sm{i}", 5, 12, temperature=0.7, seed=i) for i in range(3)]
    res = eng.generate(batch)[0]
    with torch.no_grad():
        logits = model(torch.tensor([greedy.prompt_ids + res.token_ids]))[0, len(greedy.prompt_ids) - 1 : -1]
    want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)
    assert res.token_ids == tuple(logits.argmax(-1).tolist())


def _filtered_logprobs(z: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """log-probs of softmax(z) over the top-k, then smallest top-p set (others -inf), renormalized."""
    if top_k:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    if top_p < 1:
        p, order = torch.softmax(z, -1).sort(dim=-1, descending=True)
        drop = (p.cumsum(-1) - p) >= top_p  # mass before a token already reaches top_p
        z = z.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.log_softmax(z, -1)


def test_abort_returns_the_partial_and_resume_uses_the_remaining_budget(eng):
    full = eng.generate([_req("a", max_new=40, seed=3)])[0]
    eng.add(_req("a", max_new=40, seed=3))
    eng.add(_req("w", max_new=40, seed=4))
    while eng.num_running < 2:
        eng.step()
    eng.step()
    part = eng.abort("a")
    assert part.finish == Finish.ABORTED and 0 < len(part.token_ids) < 40 and "a" not in eng
    assert part.token_ids == full.token_ids[: len(part.token_ids)]  # the seeded prefix, unchanged
    assert part.logprobs == pytest.approx(full.logprobs[: len(part.token_ids)], abs=1e-5)
    eng.abort("w")
    assert eng.num_running == eng.num_waiting == 0
    base = _req("a", max_new=40, seed=3)
    resumed = GenRequest("a2", base.prompt_ids, base.params, 0, part.token_ids, part.logprobs, part.versions)
    out = eng.generate([resumed])[0]
    assert out.finish == Finish.LENGTH and len(out.token_ids) == 40
    assert out.token_ids[: len(part.token_ids)] == part.token_ids and out.versions == (0,) * 40


def test_stop_tokens_end_a_request_with_the_stop_token_last(eng):
    runs = eng.generate([_req(f"t{i}", max_new=30, seed=i, stop_token_ids=(5, 11, 17)) for i in range(6)])
    stopped = [r for r in runs if r.finish == Finish.STOP]
    assert stopped, "no request sampled a stop token: pick other stop ids"
    for r in runs:
        stops = [t for t in r.token_ids if t in (5, 11, 17)]
        assert stops == ([r.token_ids[-1]] if r.finish == Finish.STOP else [])


def test_a_step_is_bounded_work(eng):
    """Twelve 50-token prompts, 4 slots, at most max_context (128) tokens a step: no step runs more
    than the slots or the budget, so the 600 prompt tokens take at least 5 steps, and all finish."""
    assert eng.prefill_tokens == CONTEXT  # the 16 asked for, raised to a whole prompt
    reqs = [_req(f"b{i}", 50, 6, seed=i) for i in range(12)]
    for r in reqs:
        eng.add(r)
    events = []
    while eng.num_running + eng.num_waiting:
        ev = eng.step()
        events.append(ev)
        assert len(ev.advanced) <= SLOTS and eng.num_running <= SLOTS
        assert ev.prefill_tokens + ev.active <= CONTEXT
    assert sum(ev.prefill_tokens for ev in events) == 600
    assert sum(1 for ev in events if ev.prefill_tokens) >= 5
    assert sorted(r.request_id for ev in events for r in ev.finished) == sorted(r.id for r in reqs)


def test_a_weight_update_gives_the_new_weights_outputs(ckpts):
    """Version 1 loaded from tailrace's own parameter names: greedy tokens become those of tailrace's
    engine on the version-1 weights; a request of the replaced version is refused; a load waits for
    an idle engine."""
    eng = _vllm(ckpts[0])
    reqs = [_req(f"u{i}", 4 + i, 12, temperature=0.0) for i in range(3)]
    new = load_pretrained(ckpts[1])
    before = [r.token_ids for r in eng.generate(reqs)]
    want = [r.token_ids for r in TailraceEngine(load_pretrained(ckpts[1]), num_slots=SLOTS).generate(reqs)]
    assert before != want
    state = {n: t.detach() for n, t in new.named_parameters(remove_duplicate=False)}
    eng.add(_req("busy"))
    with pytest.raises(EngineError, match="one version at a time"):
        eng.load_weights(state, 1)
    eng.abort("busy")
    eng.load_weights(state, 1)
    assert eng.versions == (1,)
    v1 = [GenRequest(r.id, r.prompt_ids, r.params, version=1) for r in reqs]
    after = eng.generate(v1)
    assert [r.token_ids for r in after] == want and all(r.versions == (1,) * 12 for r in after)
    with pytest.raises(EngineError, match="not loaded"):
        eng.add(reqs[0])


def test_a_head_size_vllms_cpu_attention_lacks_is_refused_at_start(tmp_path):
    save_pretrained(tiny_model(), tmp_path / "h16")  # 4 heads of 16
    with pytest.raises(EngineError, match="head size is 16.*rollout.backend=tailrace"):
        _vllm(tmp_path / "h16")


def test_build_engine_names_the_input_each_backend_takes(ckpts):
    with pytest.raises(EngineError, match="checkpoint directory"):
        build_engine(tiny_model(**SHAPE), backend="vllm")
    with pytest.raises(EngineError, match="unknown"):
        build_engine(str(ckpts[0]), backend="sglang")


def _matches_before_and_after_a_reload(tmp_path, shape: dict, norms: tuple[str, ...]) -> None:
    """vLLM's own model class for `shape` gives tailrace's engine's greedy tokens and logprobs, before
    and after a reload from tailrace's names; the second model's weights named with any of `norms` are
    moved away from 1, so a reload that missed them would show."""
    models = [tiny_model(seed=s, **dict(SHAPE, **shape)) for s in (0, 1)]
    with torch.no_grad():
        for p in (p for n, p in models[1].named_parameters() if any(k in n for k in norms)):
            p.uniform_(0.5, 1.5)
    save_pretrained(models[0], tmp_path / "v0")
    eng = _vllm(tmp_path / "v0")
    reqs = [_req(f"q{i}", 3 + 2 * i, 10, temperature=0.0) for i in range(4)]
    for version, model in enumerate(models):
        if version:
            eng.load_weights({n: t.detach() for n, t in model.named_parameters(remove_duplicate=False)}, 1)
        ours = TailraceEngine(model, num_slots=SLOTS).generate(reqs)  # its version 0
        theirs = eng.generate([GenRequest(r.id, r.prompt_ids, r.params, version=version) for r in reqs])
        for a, b in zip(theirs, ours):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_a_qwen3_checkpoint_and_its_weight_update_match_tailraces_engine(tmp_path):
    """Qwen3: per-head q/k norms; heads of 32 over hidden 64."""
    shape = dict(model_type="qwen3", num_attention_heads=4, head_dim=32)
    _matches_before_and_after_a_reload(tmp_path, shape, ("q_norm.weight", "k_norm.weight"))


def test_an_olmo2_checkpoint_and_its_weight_update_match_tailraces_engine(tmp_path):
    """OLMo2: norms after attention and MLP, q/k normalized over all heads at once (heads of 32)."""
    _matches_before_and_after_a_reload(tmp_path, dict(model_type="olmo2"), ("norm",))


def test_a_windowed_mistral_checkpoint_matches_tailraces_engine_past_its_window(tmp_path):
    """Mistral v0.1's layout with a window of 6 positions, shorter than every request: vLLM's windowed
    attention is tailrace's engine's."""
    _matches_before_and_after_a_reload(tmp_path, dict(model_type="mistral", sliding_window=6), ("norm",))


def test_a_smollm3_checkpoint_and_its_weight_update_match_tailraces_engine(tmp_path):
    """SmolLM3: Llama's layout with no RoPE in some layers (here the second)."""
    _matches_before_and_after_a_reload(tmp_path, dict(model_type="smollm3", no_rope_layers=(1, 0)), ("norm",))


def test_a_phi3_checkpoint_with_longrope_matches_tailraces_engine_and_is_held_to_its_short_range(tmp_path):
    """Phi-3.5's layout: q/k/v and gate/up fused in the checkpoint (vLLM's Phi3 class reads them, and a
    reload by tailrace's separate names fills them), LongRoPE's short factors with cos and sin scaled
    (its range 128 of 256 positions); a context past that range is refused, as by tailrace's engine."""
    rope = {
        "rope_type": "longrope", "original_max_position_embeddings": CONTEXT,
        "short_factor": [1.0 + i / 8 for i in range(16)], "long_factor": [4.0] * 16,
    }  # fmt: skip
    _matches_before_and_after_a_reload(tmp_path, dict(model_type="phi3", rope_scaling=rope), ("norm",))
    assert "qkv_proj" in "".join(safe_open(str(tmp_path / "v0" / "model.safetensors"), "pt").keys())
    with pytest.raises(EngineError, match=f"original_max_position_embeddings={CONTEXT}"):
        _vllm(tmp_path / "v0", max_context=CONTEXT + 1)


def test_a_phi4_mini_checkpoint_matches_tailraces_engine(tmp_path):
    """Phi-4-mini's layout: Phi-3's, tied, RoPE on the first 3/4 of each head (24 of 32 dims) with
    LongRoPE over them; vLLM's rotary of that width is tailrace's, before and after a reload."""
    rope = {
        "rope_type": "longrope", "original_max_position_embeddings": CONTEXT,
        "short_factor": [1.0 + i / 8 for i in range(12)], "long_factor": [4.0] * 12,
    }  # fmt: skip
    shape = dict(model_type="phi3", rope_scaling=rope, partial_rotary_factor=0.75, tie_word_embeddings=True)
    _matches_before_and_after_a_reload(tmp_path, shape, ("norm",))


def test_an_olmo3_checkpoint_matches_tailraces_engine_past_its_window(tmp_path):
    """OLMo3 (served by vLLM's transformers backend): a sliding layer (window 6, shorter than every
    request) rotating by its own RoPE (theta 1000) and a full one by YaRN's; tokens and logprobs before and
    after a reload."""
    shape = dict(
        model_type="olmo3", layer_types=("sliding_attention", "full_attention"), sliding_window=6,
        local_rope={"rope_theta": 1000.0},
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )  # fmt: skip
    _matches_before_and_after_a_reload(tmp_path, shape, ("norm",))


def test_a_gemma3_checkpoint_matches_tailraces_engine_past_its_window(tmp_path):
    """Gemma 3 (vLLM's Gemma3ForCausalLM): norms before and after attention and MLP scaling by 1 + their
    weights, per-head q/k norms, GeGLU, scaled embeddings, tied; a sliding layer (window 6, shorter than
    every request) with RoPE theta 1e4 and a full one with linear RoPE; before and after a reload."""
    shape = dict(
        model_type="gemma3_text", layer_types=("sliding_attention", "full_attention"), sliding_window=6,
        hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24, tie_word_embeddings=True,
        local_rope={"rope_theta": 1e4}, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
    )  # fmt: skip
    _matches_before_and_after_a_reload(tmp_path, shape, ("norm",))


def test_a_gemma2_checkpoint_matches_tailraces_engine_with_its_softcaps(tmp_path):
    """Gemma 2 (vLLM's Gemma2ForCausalLM): Gemma 3's layer without q/k norms, a sliding layer (window 6)
    and a full one, its scores capped at 1.0 and its logits at 2.0 (small enough to bite), tied."""
    shape = dict(
        model_type="gemma2", layer_types=("sliding_attention", "full_attention"), sliding_window=6,
        query_pre_attn_scalar=24, tie_word_embeddings=True, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
    )  # fmt: skip
    _matches_before_and_after_a_reload(tmp_path, shape, ("norm",))


def test_a_granite_checkpoint_matches_tailraces_engine(tmp_path):
    """Granite 3's layout: Llama's with its four scalars (embeddings x12, each output into the residual
    x0.22, attention scores x1/128, logits /8); vLLM's Granite class, before and after a reload."""
    shape = dict(
        model_type="granite", tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0078125, logits_scaling=8.0,
    )  # fmt: skip
    _matches_before_and_after_a_reload(tmp_path, shape, ("norm",))


MOE_FAMILIES = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_attention_heads=4, head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=(1,),
    ),
    "qwen2_moe": dict(  # Qwen2's biased q/k/v (vLLM's class takes head_dim as hidden / heads); a sparse
        # layer with its shared expert and that expert's sigmoid gate, and a dense one
        model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, mlp_only_layers=(1,),
    ),
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=64, rms_norm_eps=1e-5),
    "mixtral": dict(
        model_type="mixtral", num_experts=4, num_experts_per_tok=2, intermediate_size=64, norm_topk_prob=True
    ),
    "granitemoe": dict(
        model_type="granitemoe", num_experts=4, num_experts_per_tok=2, intermediate_size=64, tie_word_embeddings=True,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=0.5,
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_an_moe_checkpoint_matches_tailraces_engine_and_a_reload_is_refused_on_cpu(tmp_path, family):
    """Qwen3-MoE (vLLM's Qwen3MoeForCausalLM, its fused-MoE kernel: Qwen3's attention, a layer of four
    experts choosing two a token, renormalized, and a dense one) and OLMoE (OlmoeForCausalLM: q and k
    normed over their whole width, every layer's experts, not renormalized). vLLM's CPU build reloads the
    experts wrongly (the same weights reloaded change its tokens, checked here through vLLM itself), so
    the engine refuses a reload there, naming the fix. vLLM's OLMoE class fixes what OLMoE's checkpoints
    set (eps 1e-5, no renormalizing): another setting is refused, not served differently."""
    shape = dict(num_hidden_layers=2, **MOE_FAMILIES[family])
    model = tiny_model(seed=0, **dict(SHAPE, **shape))
    save_pretrained(model, tmp_path / "v0")
    eng = _vllm(tmp_path / "v0")
    reqs = [_req(f"q{i}", 3 + 2 * i, 10, temperature=0.0) for i in range(4)]
    ours = TailraceEngine(model, num_slots=SLOTS).generate(reqs)
    theirs = eng.generate(reqs)
    for a, b in zip(theirs, ours):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    with pytest.raises(EngineError, match="rollout.backend=tailrace"):
        eng.load_weights({n: t.detach() for n, t in model.named_parameters()}, 1)
    # what the refusal guards against: vLLM's own reload of the same weights (if a vLLM upgrade makes this
    # fail, its reload works: drop the refusal)
    eng._reload_broken = False
    eng.load_weights({n: t.detach() for n, t in model.named_parameters()}, 1)
    again = eng.generate([GenRequest(r.id, r.prompt_ids, r.params, version=1) for r in reqs])
    assert [a.token_ids for a in again] != [b.token_ids for b in ours]
    with pytest.raises(EngineError, match="LoRA adapters on a mixture-of-experts"):
        _vllm(tmp_path / "v0", lora_rank=4)
    if family == "olmoe":
        save_pretrained(tiny_model(seed=0, **dict(SHAPE, **shape, norm_topk_prob=True)), tmp_path / "renorm")
        with pytest.raises(EngineError, match="norm_topk_prob"):
            _vllm(tmp_path / "renorm")
    if family == "qwen2_moe":  # vLLM's class biases q/k/v whatever the config says
        save_pretrained(tiny_model(seed=0, **dict(SHAPE, **shape, attention_bias=False)), tmp_path / "nobias")
        with pytest.raises(EngineError, match="qkv_bias false"):
            _vllm(tmp_path / "nobias")
