"""LoRA adapters in the engine: one forward serves rows of several adapters (and rows of none), and each
row gets what its adapter's requests get alone, token for token, on both backends, in fp32 and bf16."""

from __future__ import annotations

import copy

import pytest
import torch

from tailrace.config.train import LoraConfig
from tailrace.engine import adapters as adapters_mod
from tailrace.engine import ckernel
from tailrace.engine.backends import torch_ref, weights
from tailrace.engine.backends.linear import packing_supported
from tailrace.engine.engine import TailraceEngine
from tailrace.engine.errors import EngineError
from tailrace.engine.spec import SpecOptions
from tailrace.model import lora
from tests.engine.engine_helpers import MOE, full_logprobs, req, tiny_model

# (rank, alpha, targets): every projection; attention only, lower rank; the MLP only, higher rank
SPECS = {
    "a": (4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "b": (2, 4.0, ("q_proj", "v_proj")),
    "c": (8, 8.0, ("gate_proj", "up_proj", "down_proj")),
}
BACKENDS = ["bmm"] + (["kernel"] if ckernel.load() is not None else [])


def adapted(base, name: str, seed: int):
    """`base` with adapter `name` of SPECS, B random (an update that changes tokens)."""
    rank, alpha, targets = SPECS[name]
    torch.manual_seed(seed)
    m = lora.attach(copy.deepcopy(base), LoraConfig(rank=rank, alpha=alpha, targets=targets))
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, lora.LoRALinear):
                mod.lora_B.weight.normal_(0.0, 0.3)
    return m.eval()


@pytest.fixture(scope="module")
def models():
    base = tiny_model(seed=0)
    return base, {n: adapted(base, n, seed) for seed, n in enumerate(SPECS, start=1)}


def requests():
    """Four requests per adapter and four of the base, interleaved, prompts of 3-20 tokens."""
    out = []
    for i in range(16):
        name = ("a", "b", "c", "")[i % 4]
        r = req(f"r{i}", 3 + (7 * i) % 18, 10 + i % 5)
        out.append(type(r)(r.id, r.prompt_ids, r.params, adapter=name))
    return out


def engine(base, adapters, attention, dtype):
    eng = TailraceEngine(base, num_slots=32, attention=attention, dtype=dtype, block_size=8)
    for n, m in adapters.items():
        eng.load_adapter(n, lora.adapter_of(m))
    return eng


def mixed_and_alone(base, adapters, attention, dtype):
    """(result of each request in one mixed batch, of each request among its adapter's alone)."""
    eng = engine(base, adapters, attention, dtype)
    assert eng.backend == attention
    reqs = requests()
    mixed = {r.request_id: r for r in eng.generate(reqs)}
    alone = {}
    for name in ("a", "b", "c", ""):
        own = [r for r in reqs if r.adapter == name]
        alone.update({r.request_id: r for r in engine(base, adapters, attention, dtype).generate(own)})
    return mixed, alone


@pytest.fixture
def batch_invariant_base(monkeypatch):
    """The base step's two batch-size-dependent choices pinned: fp32 GEMMs on oneDNN's packed weights
    at every batch (MKL's per-row sums change with the row count; the engine packs them at >= 48 rows
    here, at every batch from hidden 512 and in bf16), and the torch backend's bf16 decode attention on
    fp32 copies at every batch (`UPCAST_MAX_BATCH`). Without them the base model's own rows differ
    between batch sizes (fp32: ~1 ulp; bf16 torch: up to ~0.06), adapter or not."""
    if not packing_supported(torch.float32):
        pytest.skip("no oneDNN packed GEMMs here: fp32 sums depend on the batch size")
    monkeypatch.setattr(weights, "PACKED_FP32_MIN_HIDDEN", 0)
    monkeypatch.setattr(torch_ref, "UPCAST_MAX_BATCH", 10**9)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", BACKENDS)
def test_mixed_adapter_batch_equals_each_adapter_alone(models, attention, dtype, batch_invariant_base):
    """Token for token and logprobs within 1e-6: the adapter terms add nothing that depends on which
    other rows (of other adapters, or of none) share the batch."""
    mixed, alone = mixed_and_alone(*models, attention, dtype)
    for rid, r in alone.items():
        assert mixed[rid].token_ids == r.token_ids, rid
        assert max(abs(x - y) for x, y in zip(mixed[rid].logprobs, r.logprobs)) < 1e-6, rid


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gathered_adapter_terms_equal_each_adapter_alone(models, dtype, batch_invariant_base, monkeypatch):
    """The accelerators' path (each token's A and B^T gathered by its slot, batched one-row GEMMs), run
    here on the torch backend: mixed rows equal each adapter's alone, and the per-slot groups' tokens."""
    grouped, _ = mixed_and_alone(*models, "bmm", dtype)
    monkeypatch.setattr(adapters_mod, "gathered", lambda device: True)
    mixed, alone = mixed_and_alone(*models, "bmm", dtype)
    for rid, r in alone.items():
        assert mixed[rid].token_ids == r.token_ids == grouped[rid].token_ids, rid
        assert max(abs(x - y) for x, y in zip(mixed[rid].logprobs, r.logprobs)) < 1e-6, rid


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", BACKENDS)
def test_mixed_adapter_batch_as_the_engine_is_built(models, attention, dtype):
    """The engine's own settings: the same tokens; fp32 logprobs within the base step's batch noise."""
    base, adapters = models
    mixed, alone = mixed_and_alone(base, adapters, attention, dtype)
    for rid, r in alone.items():
        assert mixed[rid].token_ids == r.token_ids, rid
        if dtype == "fp32":
            assert max(abs(x - y) for x, y in zip(mixed[rid].logprobs, r.logprobs)) < 1e-5, rid
    reqs = requests()
    # the adapters change what is generated: the same prompt and seed without an adapter differ
    plain = engine(base, adapters, attention, dtype).generate(
        [type(r)(r.id, r.prompt_ids, r.params) for r in reqs]
    )
    differ = sum(p.token_ids != mixed[p.request_id].token_ids for p in plain)
    assert differ >= 9  # 12 adapted requests; the 4 base ones agree


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "olmo2", "smollm3"])
@pytest.mark.parametrize("attention", BACKENDS)
def test_adapter_rows_equal_the_adapted_model(models, attention, model_type):
    """fp32: each row's logprobs are the full-sequence forward of its model (base + its adapter); on
    Qwen3 and OLMo2 the adapted q and k are normalized after their low-rank terms, as PEFT's model does,
    and on OLMo2 the adapted o and down outputs before their post-norms; on SmolLM3 with a first layer
    without RoPE."""
    base, adapters = models
    if model_type != "llama":
        nope = dict(no_rope_layers=(0, 1)) if model_type == "smollm3" else {}
        base = tiny_model(seed=0, model_type=model_type, head_dim=24, **nope)
        adapters = {n: adapted(base, n, seed) for seed, n in enumerate(SPECS, start=1)}
    eng = engine(base, adapters, attention, "fp32")
    reqs = requests()
    for r, res in zip(reqs, eng.generate(reqs)):
        model = adapters[r.adapter] if r.adapter else base
        ref = full_logprobs(model, r.prompt_ids, res.token_ids)
        assert max(abs(x - y) for x, y in zip(ref, res.logprobs)) < 1e-4


def test_adapters_load_replace_and_drop(models):
    base, adapters = models
    eng = TailraceEngine(base, num_slots=4)
    assert eng.capabilities.adapters and eng.adapters == ()
    r = req("x", 5, 8)
    wants = type(r)(r.id, r.prompt_ids, r.params, adapter="a")
    with pytest.raises(EngineError, match="adapter 'a'.*not loaded"):
        eng.add(wants)
    eng.load_adapter("a", lora.adapter_of(adapters["b"]))  # the wrong weights first ...
    eng.load_adapter("c", lora.adapter_of(adapters["c"]))
    eng.load_adapter("a", lora.adapter_of(adapters["a"]))  # ... replaced in place (and a larger rank)
    assert eng.adapters == ("a", "c")
    eng.add(wants)
    with pytest.raises(EngineError, match="waiting or running"):
        eng.drop_adapter("a")
    done = []
    while eng.num_running or eng.num_waiting:
        done += eng.step().finished
    (res,) = done
    ref = full_logprobs(adapters["a"], wants.prompt_ids, res.token_ids)
    assert max(abs(x - y) for x, y in zip(ref, res.logprobs)) < 1e-4
    eng.drop_adapter("a")
    eng.load_adapter("b", lora.adapter_of(adapters["b"]))  # takes the freed slot
    assert eng.adapters == ("b", "c")
    wrong = lora.adapter_of(adapted(tiny_model(hidden_size=32, intermediate_size=64), "a", 9))
    with pytest.raises(EngineError, match="this base model"):
        eng.load_adapter("d", wrong)


@pytest.mark.parametrize("spec", ["quant8", "history"])
@pytest.mark.parametrize("attention", BACKENDS)
def test_speculative_decoding_stays_lossless_on_adapter_rows(models, spec, attention):
    """Drafts come from the base (the drafters know no adapters); verification runs each row's drafts
    through its own adapter, so the tokens are those of the engine without speculation."""
    base, adapters = models
    reqs = requests()
    plain = engine(base, adapters, attention, "fp32").generate(reqs)
    opts = SpecOptions(spec, toggle=False)  # every decode row drafts, at every batch
    eng = TailraceEngine(base, num_slots=4, attention=attention, block_size=8, spec=opts)
    for n, m in adapters.items():
        eng.load_adapter(n, lora.adapter_of(m))
    if spec == "history":  # drafts to verify: the same prompts' responses, reversed
        for r, res in zip(reqs, plain):
            eng.add_history(r.prompt_ids, res.token_ids[::-1])
    fast = eng.generate(reqs)
    assert eng.spec_stats.verifies > 0
    for p, f in zip(plain, fast):
        assert p.token_ids == f.token_ids, p.request_id
        assert max(abs(x - y) for x, y in zip(p.logprobs, f.logprobs)) < 1e-4


@pytest.mark.parametrize("attention", BACKENDS)
def test_adapter_rows_of_a_mixture_of_experts_model_equal_the_adapted_model(attention):
    """Qwen3-MoE (a sparse layer and a dense one): adapters of its attention (the default targets mean those
    there) beside base rows; each row's logprobs are its model's full-sequence forward; an adapter of an
    MLP is refused by the engine."""
    base = tiny_model(seed=0, head_dim=24, **MOE)
    adapters = {n: adapted(base, n, seed) for seed, n in ((1, "a"), (2, "b"))}
    eng = engine(base, adapters, attention, "fp32")
    reqs = [r for r in requests() if r.adapter != "c"]
    for r, res in zip(reqs, eng.generate(reqs)):
        model = adapters[r.adapter] if r.adapter else base
        ref = full_logprobs(model, r.prompt_ids, res.token_ids)
        assert max(abs(x - y) for x, y in zip(ref, res.logprobs)) < 1e-4
    dense = lora.adapter_of(adapted(tiny_model(seed=0, head_dim=24, model_type="qwen3"), "c", 3))
    with pytest.raises(EngineError, match="mixture-of-experts"):
        eng.load_adapter("c", dense)
