"""model/moe.py: routing on hand-checked logits, and the experts' mix padded or not (values and
gradients), against a per-token loop written the obvious way."""

from __future__ import annotations

import pytest
import torch

from tailrace.model import CausalLM, ModelConfig
from tailrace.model.moe import mix, replaying, route, routes_of, split_experts, take_load
from tests.engine.test_engine_routes import own_routes


def test_route_takes_the_k_likeliest_and_renormalizes_when_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    p = torch.softmax(logits, -1)[0]  # 0.087, 0.644, 0.237, 0.032
    seen = []
    w, e = route(logits, 2, norm=False, record=lambda probs, own, used: seen.append((probs, own, used)))
    [(probs, own, used)] = seen  # what a recorder hears: the probabilities, the router's choice, the rows'
    assert e.tolist() == [[1, 2]] and torch.allclose(w, p[[1, 2]][None]) and own is e and used is e
    assert torch.allclose(probs, p[None])
    w, e = route(logits, 2, norm=True)
    assert e.tolist() == [[1, 2]] and torch.allclose(w, (p[[1, 2]] / p[[1, 2]].sum())[None])
    assert route(logits.bfloat16(), 2, norm=True)[0].dtype == torch.bfloat16  # the logits' dtype


@pytest.mark.parametrize("pad", [False, True])
def test_mix_is_each_tokens_weighted_experts_padded_or_not(pad):
    """Every token's output is the sum over its k experts of weight x expert(token), whichever experts
    no token chose (they cost nothing) and however many rows the padding adds (zeros, weighted 0);
    gradients reach the input, the router's logits and the experts alike."""
    g = torch.Generator().manual_seed(0)
    E, k, N, h = 6, 2, 37, 5  # 37 tokens: 74 choices, counts past 8 that padding rounds up
    W = torch.randn(E, h, h, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(N, h, generator=g, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(N, E, generator=g, dtype=torch.float64)
    logits[:, 5] = -50.0  # expert 5: never chosen
    logits.requires_grad_(True)
    calls = []

    def expert(e, rows):
        calls.append((e, rows.shape[0]))
        return torch.tanh(rows @ W[e])

    y = mix(x, logits, k, True, expert, pad=pad)
    w, ex = route(logits, k, True)
    want = torch.stack([sum(w[t, j] * torch.tanh(x[t] @ W[ex[t, j]]) for j in range(k)) for t in range(N)])
    assert torch.allclose(y, want, atol=1e-12)
    assert 5 not in [e for e, _ in calls] and sum(n for _, n in calls) >= N * k
    assert (sum(n for _, n in calls) > N * k) == pad  # 74 choices over 5 experts: some count is past 8
    grads = torch.autograd.grad(y.square().sum(), (x, logits, W))
    ref = torch.autograd.grad(want.square().sum(), (x, logits, W))
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(grads, ref))
    assert mix(x[:0], logits[:0], k, True, expert, pad=pad).shape == (0, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_mixes_as_the_sorted_path_bit_for_bit(dtype):
    """A decode step of one sequence skips the sort, gathers and scatter (`_one_row`); its output and the
    experts' load are the sorted path's (`_rows`) exactly, with real SwiGLU experts, in fp32 and bf16,
    the experts' order in a row reversed or not."""
    from tailrace.model.moe import _one_row, _rows

    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=1, num_attention_heads=4, num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=48)  # fmt: skip
    moe = CausalLM.from_config(cfg, seed=0).to(dtype).model.layers[0].mlp
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(1, 64, generator=g).to(dtype)
        weights, experts = route(moe.gate(x), 3, True)
        for ex in (experts, experts.flip(-1)):  # top-k's order, and the reverse
            w = weights if ex is experts else weights.flip(-1)
            loads = [[0] * 8, [0] * 8]
            fast = _one_row(x, w, ex, moe._expert, loads[0])
            slow = _rows(x, w, ex, 8, moe._expert, False, loads[1])
            assert torch.equal(fast, slow) and loads[0] == loads[1] and sum(loads[0]) == 3


def test_transformers_stacked_experts_split_into_the_checkpoints_matrices():
    gate_up, down = torch.arange(2 * 6 * 3.0).view(2, 6, 3), torch.arange(2 * 3 * 3.0).view(2, 3, 3)
    out = split_experts(
        {"m.mlp.experts.gate_up_proj": gate_up, "m.mlp.experts.down_proj": down, "other": down}
    )
    assert torch.equal(out["m.mlp.experts.1.gate_proj.weight"], gate_up[1, :3])
    assert torch.equal(out["m.mlp.experts.1.up_proj.weight"], gate_up[1, 3:])
    assert torch.equal(out["m.mlp.experts.0.down_proj.weight"], down[0]) and out["other"] is down
    assert len(out) == 7


def test_the_load_counts_each_experts_tokens_and_take_load_reads_it_once():
    """A sparse layer counts the (token, choice) slots each expert took; `take_load` gives the busiest
    expert's share over an even one's and the idle experts' fraction, then starts over."""
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)  # fmt: skip
    model = CausalLM.from_config(cfg, seed=0)
    assert take_load(model) == {}
    with torch.no_grad():
        model(torch.arange(6)[None])
    assert [sum(layer.mlp.load) for layer in model.model.layers] == [6 * 2, 6 * 2]  # 6 tokens, 2 choices each
    for layer in model.model.layers:
        layer.mlp.load = [6, 6, 0, 0]  # two of four experts: the busiest at twice an even share
    assert take_load(model) == {"moe_load_max": 2.0, "moe_idle": 0.5}
    assert take_load(model) == {}


def test_route_takes_the_experts_given_with_this_routers_weights():
    """Routing replay: a row given experts takes them, weighted by this router's probabilities of them
    (renormalized as the model does); a row of -1 chooses its own; the router's own choice comes back."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [0.0, 2.0, 1.0, -1.0]])
    p = torch.softmax(logits[0], -1)
    given = torch.tensor([[3, 0], [-1, -1]], dtype=torch.int16)
    seen = []
    w, e = route(logits, 2, norm=True, given=given, record=lambda probs, own, used: seen.append(own))
    assert e.tolist() == [[3, 0], [1, 2]] and seen[0].tolist() == [[1, 2], [1, 2]]
    assert torch.allclose(w[0], p[[3, 0]] / p[[3, 0]].sum())
    assert torch.allclose(w[1], p[[1, 2]] / p[[1, 2]].sum())


def _moe_model() -> CausalLM:
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                      num_attention_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                      mlp_only_layers=(1,))  # fmt: skip
    return CausalLM.from_config(cfg, seed=0).eval()


def test_replaying_a_models_own_routes_changes_nothing_and_other_routes_are_taken_and_counted():
    """Inside `replaying`, each sparse layer takes its slice of the routes (the dense layer between them
    none): its own routes give the same logits bit for bit; others move them, and `take_load` counts the
    replayed (position, layer)s this router would have chosen otherwise; -1 positions choose their own."""
    model, ids = _moe_model(), torch.arange(12).view(2, 6)
    with torch.no_grad():
        plain = model(ids)
    own = torch.stack([own_routes(model, tuple(row.tolist())) for row in ids])
    assert own.shape == (2, 6, 2, 2)
    take_load(model)
    with torch.no_grad(), replaying(model, own.to(torch.int16)):
        assert torch.equal(model(ids), plain)
    assert take_load(model)["moe_route_flips"] == 0.0
    other = own.clone()
    other[0, :3] = (own[0, :3] + 1) % 4  # 3 positions x 2 layers: other experts (a shifted pair of 4)
    other[1] = -1  # the second row: no routes, its own
    with torch.no_grad(), replaying(model, other.to(torch.int16)):
        moved = model(ids)
    assert not torch.equal(moved[0], plain[0]) and torch.equal(moved[1], plain[1])
    assert not torch.equal(moved[0, 3:], plain[0, 3:])  # later positions attend to the moved ones
    assert take_load(model)["moe_route_flips"] == pytest.approx(6 / 12)  # of 12 replayed (position, layer)s
    assert all(m.given is None for m in model.modules() if hasattr(m, "given"))
    with pytest.raises(ValueError, match="routes of 1 sparse layers for a model of 2"):
        with replaying(model, own[:, :, :1]):
            pass


def test_routes_of_reads_an_engines_bytes_and_refuses_a_partial_position():
    cfg = _moe_model().config
    data = bytes(range(3 * 2 * 2))  # 3 positions x 2 sparse layers x k=2
    assert routes_of(data, cfg).tolist()[2] == [[8, 9], [10, 11]] and routes_of(b"", cfg).shape == (0, 2, 2)
    with pytest.raises(ValueError, match="not whole positions"):
        routes_of(data[:-1], cfg)


def test_the_load_balancing_loss_is_transformers_over_the_real_tokens(tmp_path):
    """`balancing` + `balance_loss` over a padded batch equal transformers' aux_loss of Qwen3MoeForCausalLM
    (output_router_logits on) under the same attention mask, and move the router's gradient."""
    from transformers import AutoModelForCausalLM

    from tailrace.model import save_pretrained
    from tailrace.model.moe import balance_loss, balancing

    model = _moe_model()
    save_pretrained(model, tmp_path / "m")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "m", output_router_logits=True).eval()
    ids = torch.arange(14).view(2, 7) % 32
    valid = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])  # the second row padded after 4
    with torch.no_grad():
        want = theirs(ids, attention_mask=valid.long()).aux_loss
    with balancing(model, valid) as stats:
        model(ids)
    got = balance_loss(stats, 4)
    assert len(stats) == 2 and sum(n for _, _, n in stats) == 2 * 11  # two sparse layers, 11 real tokens
    assert torch.allclose(got, want.float(), atol=1e-6), (got, want)
    got.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    with balancing(model, None) as stats:
        model(ids)
    assert stats == [] and all(m.balance is None for m in model.modules() if hasattr(m, "balance"))
