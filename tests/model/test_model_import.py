"""`tailrace model import`: GGUF files and transformers directories become checkpoints tailrace reads,
with the same logits as the source and the tokenizer and chat template carried over."""

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tailrace.cli import main
from tailrace.model.checkpoint import CheckpointError, load_pretrained
from tailrace.model.importer import import_model

gguf = pytest.importorskip("gguf")
SPECIALS = ["<unk>", "<s>", "</s>"]
TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
IDS = torch.tensor([[5, 9, 40, 3, 77]])


def tiny_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world 1+2=3 the quick brown fox"] * 50, trainer)
    return tok


def tiny_llama(vocab: int, tie: bool = True) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of q/k rows for its RoPE (what GGUF files hold; transformers undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model: LlamaForCausalLM, tok: Tokenizer) -> None:
    """The model and tokenizer as an F32 GGUF file, in llama.cpp's tensor and metadata names."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(TEMPLATE)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}  # fmt: skip
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"])
        w.add_tensor(
            f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads)
        )
        w.add_tensor(
            f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads)
        )
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_round_trips_to_the_same_logits_tokenizer_and_template(tmp_path):
    tok = tiny_bpe()
    model = tiny_llama(tok.get_vocab_size())
    write_gguf(tmp_path / "tiny.gguf", model, tok)
    r = import_model(tmp_path / "tiny.gguf", tmp_path / "out")
    assert r.max_logit_diff == 0.0 and r.chat_template
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "out")(IDS), model(IDS).logits)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert hf_tok("hello world").input_ids == tok.encode("hello world").ids
    assert hf_tok.chat_template == TEMPLATE
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()  # transformers reads it as is
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize(
    "arch",
    [
        "llama-untied",
        "qwen2",
        "qwen3",
        "qwen3-moe",
        "qwen2-moe",
        "olmoe",
        "mixtral",
        "granitemoe",
        "phi3",
        "phi4-mini",
        "olmo3",
        "granite",
        "gemma2",
        "gemma3-image-text",
    ],
)
def test_a_transformers_directory_imports_and_keeps_its_tokenizer(tmp_path, arch):
    tok = tiny_bpe()
    V = tok.get_vocab_size()
    if arch != "llama-untied":  # Qwen3: q/k norms, heads of 16 over hidden 32 (head_dim explicit)
        torch.manual_seed(0)
        shape = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
        if arch == "qwen3":
            model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **shape)).eval()
            with torch.no_grad():  # norms away from HF's init of 1, so one not imported would show
                for n, p in model.named_parameters():
                    if n.endswith(("q_norm.weight", "k_norm.weight")):
                        p.uniform_(0.5, 1.5)
        elif arch == "qwen3-moe":  # transformers' experts fused in memory (one 3-D weight each): split
            cfg = Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                 norm_topk_prob=True, **shape)  # fmt: skip
            model = Qwen3MoeForCausalLM(cfg).eval()
            with torch.no_grad():  # the router away from its init of 0 (ties would pick by index)
                for n, p in model.named_parameters():
                    if n.endswith("mlp.gate.weight"):
                        p.normal_(0.0, 1.0)
        elif arch == "qwen2-moe":  # Qwen2's biased q/k/v; a dense layer, a sparse one with its shared expert
            cfg = Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                 shared_expert_intermediate_size=40, mlp_only_layers=[0], **shape)  # fmt: skip
            model = Qwen2MoeForCausalLM(cfg).eval()
            with torch.no_grad():  # the router and the shared expert's gate away from their init
                for n, p in model.named_parameters():
                    if n.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "_proj.bias")):
                        p.normal_(0.0, 1.0)
        elif (
            arch == "olmoe"
        ):  # q and k normed over their whole width; every layer's experts, as Qwen3-MoE's fused
            model = OlmoeForCausalLM(
                OlmoeConfig(num_experts=4, num_experts_per_tok=2, pad_token_id=0, **shape)
            ).eval()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n.endswith("mlp.gate.weight"):
                        p.normal_(0.0, 1.0)
                    elif n.endswith(("q_norm.weight", "k_norm.weight")):
                        p.uniform_(0.5, 1.5)
        elif arch == "mixtral":  # transformers 5 names its block_sparse_moe mlp and stacks the experts
            model = MixtralForCausalLM(
                MixtralConfig(num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, **shape)
            ).eval()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n.endswith("mlp.gate.weight"):
                        p.normal_(0.0, 1.0)
        elif arch == "granitemoe":  # Granite's scalars; its experts stacked on disk as in memory
            cfg = GraniteMoeConfig(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                                   residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=6.0,
                                   pad_token_id=0, **shape)  # fmt: skip
            model = GraniteMoeForCausalLM(cfg).eval()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n.endswith("router.weight"):
                        p.normal_(0.0, 1.0)
        elif arch == "phi3":  # q/k/v and gate/up fused; LongRoPE (short factors, cos and sin scaled)
            rope = {"rope_type": "longrope", "original_max_position_embeddings": 32,
                    "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [4.0] * 4}  # fmt: skip
            model = Phi3ForCausalLM(
                Phi3Config(rope_parameters=rope, original_max_position_embeddings=32, pad_token_id=0, **shape)
            )
            model = model.eval()
        elif arch == "phi4-mini":  # Phi-3's, tied, RoPE on 6 of each head's 8 dims (config.json's top level)
            rope = {"rope_type": "longrope", "original_max_position_embeddings": 32,
                    "short_factor": [1.0, 1.3, 1.7], "long_factor": [4.0] * 3}  # fmt: skip
            cfg = Phi3Config(rope_parameters=rope, original_max_position_embeddings=32, pad_token_id=0,
                             partial_rotary_factor=0.75, tie_word_embeddings=True, **shape)  # fmt: skip
            model = Phi3ForCausalLM(cfg).eval()
        elif arch == "olmo3":  # sliding layers (window 16) with plain RoPE, the full one with YaRN
            rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
            cfg = Olmo3Config(
                sliding_window=16, rope_scaling=rope, pad_token_id=0, **{**shape, "num_hidden_layers": 4}
            )
            model = Olmo3ForCausalLM(cfg).eval()
        elif arch == "granite":  # its scalars: embeddings, residual, attention scores, logits
            cfg = GraniteConfig(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.03,
                                logits_scaling=8.0, tie_word_embeddings=True, pad_token_id=0, **shape)  # fmt: skip
            model = GraniteForCausalLM(cfg).eval()
        elif arch == "gemma2":  # its softcaps (small enough to bite), alternating windowed layers (window 3)
            cfg = Gemma2Config(sliding_window=3, query_pre_attn_scalar=8, head_dim=8, attn_logit_softcapping=2.0,
                               attn_implementation="eager",
                               final_logit_softcapping=3.0, pad_token_id=0, **shape)  # fmt: skip
            model = Gemma2ForCausalLM(cfg).eval()
        elif arch == "gemma3-image-text":  # Gemma-3-4B's kind: its text model taken out (window 3, 5 tokens)
            text = Gemma3TextConfig(
                sliding_window=3, query_pre_attn_scalar=16, head_dim=8, pad_token_id=0, **shape
            )
            vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          image_size=28, patch_size=14)  # fmt: skip
            cfg = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                               image_token_index=V - 1, boi_token_index=V - 3, eoi_token_index=V - 2)  # fmt: skip
            model = Gemma3ForConditionalGeneration(cfg).eval()
            with torch.no_grad():  # norms away from their init of 0 (Gemma scales by 1 + w)
                for n, p in model.named_parameters():
                    if "norm" in n:
                        p.uniform_(-0.5, 0.5)
        else:
            model = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    else:
        model = tiny_llama(V, tie=False)
    model.save_pretrained(str(tmp_path / "src"))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(
        str(tmp_path / "src")
    )
    assert main(["model", "import", str(tmp_path / "src"), "--out", str(tmp_path / "out")]) == 0
    with torch.no_grad():
        diff = (load_pretrained(tmp_path / "out")(IDS) - model(IDS).logits).abs().max()
    assert diff <= 1e-5
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    if arch == "phi4-mini":
        assert load_pretrained(tmp_path / "out").config.rotary_dim == 6
    if arch == "gemma3-image-text":
        saved = json.loads((tmp_path / "out" / "config.json").read_text())
        assert saved["architectures"] == ["Gemma3ForCausalLM"] and saved["model_type"] == "gemma3_text"


def test_pickled_weights_unsupported_models_and_occupied_outputs_are_one_line_errors(tmp_path, capsys):
    tok = tiny_bpe()
    model = tiny_llama(tok.get_vocab_size())
    (tmp_path / "pickled").mkdir()
    model.config.save_pretrained(str(tmp_path / "pickled"))
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        import_model(tmp_path / "pickled", tmp_path / "a")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("taken")
    assert main(["model", "import", str(tmp_path / "pickled"), "--out", str(tmp_path / "full")]) == 2
    err = capsys.readouterr().out
    assert "not empty" in err and "\n" not in err.strip()
    assert main(["model", "import", str(tmp_path / "nothing.txt"), "--out", str(tmp_path / "b")]) == 2
    model.save_pretrained(str(tmp_path / "no-tokenizer"))
    with pytest.raises(CheckpointError, match="no tokenizer"):
        import_model(tmp_path / "no-tokenizer", tmp_path / "c")


def test_an_import_the_free_memory_cannot_hold_is_refused_before_loading(tmp_path, monkeypatch):
    """Read from the safetensors headers alone: its fp32 weights and what writing them takes, against the
    memory free; refused in one line naming both, nothing written."""
    from tailrace.model import importer

    tok = tiny_bpe()
    tiny_llama(tok.get_vocab_size()).save_pretrained(str(tmp_path / "src"))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(
        str(tmp_path / "src")
    )
    monkeypatch.setattr(importer, "available_bytes", lambda device: 1 << 16)
    with pytest.raises(CheckpointError, match=r"needs about .* GiB and 0\.0 GiB are free") as e:
        import_model(tmp_path / "src", tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
