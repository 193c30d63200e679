"""Checkpoints of the families whose layout is not Llama's train end to end, made from the tiny model
by their config.json: a Mistral v0.1 (a sliding window shorter than its positions), whose sequences run
past the window; a SmolLM3 (a layer without RoPE), whose trained
checkpoint transformers reads as tailrace does; a Phi-3.5 (fused projections, LongRoPE), held to LongRoPE's
short range, whose LoRA run's adapter peft loads onto transformers' Phi-3 as tailrace merges it."""

import json
import shutil

import pytest
import torch

from tests.runtime.conftest import TINY_RUN, as_gemma3, as_phi3, as_qwen3_moe, checkpoints, one_line, run


def relabeled(tiny_model, to, **config):
    """A copy of the tiny model whose config.json names another family (same weights)."""
    shutil.copytree(tiny_model, to)
    d = json.loads((to / "config.json").read_text())
    d.update(config)
    (to / "config.json").write_text(json.dumps({k: v for k, v in d.items() if v is not ...}))
    return to


def test_a_windowed_mistral_trains_past_its_window(capfd, tiny_model, tmp_path):
    from tailrace.records import Finished, read_journal

    src = relabeled(
        tiny_model, tmp_path / "mistral", model_type="mistral", architectures=["MistralForCausalLM"],
        sliding_window=16, attention_bias=..., mlp_bias=...,  # (MistralConfig has neither bias switch)
    )  # fmt: skip
    argv = ["train", f"--model.path={src}", *TINY_RUN, "--flow.steps=2", "--flow.mode=sync"]
    rc, out = run(capfd, *argv, f"--run-dir={tmp_path / 'run'}")
    assert rc == 0, out
    done = [e.trajectory for e in read_journal(tmp_path / "run" / "journal.jsonl") if isinstance(e, Finished)]
    assert max(len(t.prompt_ids) + len(t.result.token_ids) for t in done) > 16  # sequences past the window
    saved = json.loads((checkpoints(tmp_path / "run")[-1] / "model" / "config.json").read_text())
    assert (saved["model_type"], saved["sliding_window"]) == ("mistral", 16)  # transformers windows it too


def test_a_smollm3_trains_and_transformers_reads_its_checkpoint_as_tailrace_does(capfd, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from tailrace.model import load_pretrained

    src = relabeled(
        tiny_model, tmp_path / "smollm3", model_type="smollm3", architectures=["SmolLM3ForCausalLM"],
        no_rope_layers=[1, 0],
    )  # fmt: skip
    rc, out = run(
        capfd, "train", f"--model.path={src}", *TINY_RUN, "--flow.steps=2", f"--run-dir={tmp_path / 'run'}"
    )
    assert rc == 0, out
    saved = checkpoints(tmp_path / "run")[-1] / "model"
    assert json.loads((saved / "config.json").read_text())["no_rope_layers"] == [1, 0]
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    theirs = AutoModelForCausalLM.from_pretrained(saved).eval()
    with torch.no_grad():
        assert (load_pretrained(saved)(ids) - theirs(ids).logits).abs().max() <= 1e-4


def test_a_phi3_with_longrope_trains_with_lora_and_peft_reads_its_adapter(
    capfd, tiny_model, tmp_path, digits
):
    """Its checkpoint fuses q/k/v and gate/up, so it is the tiny model saved by tailrace as a Phi-3, not
    relabeled; a run is held to LongRoPE's short range, and its LoRA adapter comes out for the fused modules."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tailrace.model import load_pretrained, lora

    as_phi3(tiny_model, tmp_path / "phi3")
    argv = [
        "train",
        f"--model.path={tmp_path / 'phi3'}",
        *TINY_RUN,
        "--flow.steps=2",
        "--train.lora.rank=4",
        "--train.lora.alpha=8",
        "--train.lr=0.05",
        digits,
        "--flow.samples_per_prompt=8",
        "--flow.train_batch=32",
    ]  # fmt: skip  (as tests/runtime/test_lora_e2e.py: a reward to move it)

    rc, out = run(capfd, *argv, f"--run-dir={tmp_path / 'past'}", "--rollout.max_context=161")
    assert rc == 2, out
    assert (
        "rollout.max_context=161 is past the model's LongRoPE original_max_position_embeddings=160"
        in one_line(out)
    )

    rc, out = run(capfd, *argv, f"--run-dir={tmp_path / 'run'}")
    assert rc == 0, out
    assert "slots of up to 160" in out
    last = checkpoints(tmp_path / "run")[-1]
    files = json.loads((last / lora.ADAPTER_DIR / lora.ADAPTER_CONFIG).read_text())
    assert "qkv_proj" in files["target_modules"] and "q_proj" not in files["target_modules"]
    base = load_pretrained(tmp_path / "phi3")
    ours = lora.merged(
        load_pretrained(tmp_path / "phi3"), lora.load_peft(last / lora.ADAPTER_DIR, base.config)
    )
    theirs = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "phi3"), last / lora.ADAPTER_DIR
    )
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - theirs.eval()(ids).logits).abs().max() <= 1e-4
        assert (ours(ids) - base(ids)).abs().max() > 1e-3  # the adapter moved the policy


def test_a_gemma3_trains_past_its_window_with_lora_and_peft_reads_its_adapter(
    capfd, tiny_model, tmp_path, digits
):
    """Gemma 3's layout (sliding layers with a window of 24, shorter than the sequences; norms before and
    after, scaling by 1 + w; GeGLU): a LoRA run trains, and transformers' Gemma3ForCausalLM with peft's
    adapter gives the logits of tailrace's merged model."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tailrace.model import load_pretrained, lora
    from tailrace.records import Finished, read_journal

    as_gemma3(tiny_model, tmp_path / "gemma3")
    argv = [
        "train", f"--model.path={tmp_path / 'gemma3'}", *TINY_RUN, "--flow.steps=2", "--train.lora.rank=4",
        "--train.lora.alpha=8", "--train.lr=0.05", digits, "--flow.samples_per_prompt=8", "--flow.train_batch=32",
        f"--run-dir={tmp_path / 'run'}",
    ]  # fmt: skip
    rc, out = run(capfd, *argv)
    assert rc == 0, out
    done = [e.trajectory for e in read_journal(tmp_path / "run" / "journal.jsonl") if isinstance(e, Finished)]
    assert max(len(t.prompt_ids) + len(t.result.token_ids) for t in done) > 24  # past the window
    last = checkpoints(tmp_path / "run")[-1]
    base = load_pretrained(tmp_path / "gemma3")
    ours = lora.merged(
        load_pretrained(tmp_path / "gemma3"), lora.load_peft(last / lora.ADAPTER_DIR, base.config)
    )
    theirs = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "gemma3"), last / lora.ADAPTER_DIR
    )
    assert type(theirs.base_model.model).__name__ == "Gemma3ForCausalLM"
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - theirs.eval()(ids).logits).abs().max() <= 1e-4
        assert (ours(ids) - base(ids)).abs().max() > 1e-3  # the adapter moved the policy


def test_a_qwen3_moe_trains_every_expert_it_routes_to_and_transformers_reads_its_checkpoint(
    capfd, tiny_model, tmp_path, digits
):
    """Qwen3-MoE's layout (four experts a layer, two a token): a full fine-tune on tailrace's engines moves
    the router and the experts, and transformers' Qwen3MoeForCausalLM reads the trained checkpoint as
    tailrace's decoder does; the report shows the routing of each step. With routing replay: every
    sampled token's routes came from the engines, and (fp32 both sides) on-policy none differs from the
    trainer's."""
    from transformers import AutoModelForCausalLM

    from tailrace.model import load_pretrained
    from tailrace.report.html import write_report

    as_qwen3_moe(tiny_model, tmp_path / "moe")
    argv = [
        "train", f"--model.path={tmp_path / 'moe'}", *TINY_RUN, "--flow.steps=2", "--train.lr=0.01", digits,
        "--flow.samples_per_prompt=8", "--flow.train_batch=32", "--train.routing_replay=true",
    ]  # fmt: skip
    rc, out = run(capfd, *argv, f"--run-dir={tmp_path / 'run'}")
    assert rc == 0, out
    from tests.runtime.test_lora_e2e import step_records

    steps = [s["train"] for s in step_records(tmp_path / "run")]
    assert [s["routes_replayed"] for s in steps] == [1.0, 1.0]
    # the first step trains the weights that sampled it: no route differs (fp32; a near-tie another CPU's
    # rounding breaks apart aside); later ones may train on tokens an older version sampled (multiversion),
    # whose routes that version chose
    assert steps[0]["moe_route_flips"] < 0.01
    base, trained = (
        load_pretrained(tmp_path / "moe"),
        load_pretrained(checkpoints(tmp_path / "run")[-1] / "model"),
    )
    moved = {n for n, p in trained.named_parameters() if not torch.equal(p, base.get_parameter(n))}
    report = write_report(tmp_path / "run").read_text()
    assert "<h2>Routing</h2>" in report and "<th>tokens replayed</th>" in report
    assert any(".mlp.gate." in n for n in moved) and any(".mlp.experts." in n for n in moved)
    theirs = AutoModelForCausalLM.from_pretrained(checkpoints(tmp_path / "run")[-1] / "model").eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (trained(ids) - theirs(ids).logits).abs().max() <= 1e-4
