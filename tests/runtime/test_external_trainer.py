"""train.external: a trainer of one's own pulls each step's batch from a real run and publishes the
weights its engines generate with next (runtime/relay.py, tailrace/client.py).

- the example trainer (transformers' model, examples/external_trainer.py) trains a sync run: every
  step's samples come from the weights it published, its logprobs match the engines', the ledger is
  exact, and the last checkpoint's model is the weights it published last;
- trainers that fail come and go: one answering with weights that are not finite is refused (nothing
  published), one that dies holding a step is replaced by the next, which starts from the newest
  checkpoint and redoes the steps since; the run ends with the very weights of a run whose trainer
  never left (sync, one seed: the schedule and the sampling are reproducible);
- the configurations it cannot serve are refused in one line before anything starts;
- on a Phi-3 (q/k/v and gate/up fused in transformers' model) the example's weights and PEFT adapter,
  by the fused modules' names, reach the engines split as tailrace holds them.
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tailrace.cli import main
from tailrace.runtime.checkpoint import step_dirs
from tests.runtime.conftest import (
    TINY_RUN,
    as_bf16,
    as_phi3,
    assert_exact,
    one_line,
    recoveries,
    run,
    start_cli,
    wait_for_steps,
)

ROOT = Path(__file__).resolve().parents[2]
SYNC = [*TINY_RUN, "--flow.mode=sync", "--train.external=true"]


def steps(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["kind"] == "step"]


def trainer(run_dir, *args, module="tests.runtime.plain_trainer"):
    """Start a trainer process on `run_dir` (it waits for the run to listen)."""
    cmd = [sys.executable, "-m", module, str(run_dir), *args] if module else [sys.executable, *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def final_model(run_dir):
    last = step_dirs(run_dir / "checkpoints")[0]
    return load_file(str(last / "model" / "model.safetensors"))


def example_run(run_dir, tiny_model, digits, *extra) -> None:
    """A 4-step sync run trained by examples/external_trainer.py: every step trains on samples of the
    weights it starts from, the ones the trainer published, whose logprobs match the engine's."""
    p = trainer(run_dir, str(ROOT / "examples" / "external_trainer.py"), str(run_dir), module=None)
    assert main(["train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *SYNC, digits, *extra]) == 0
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    records = steps(run_dir)
    assert [r["version"] for r in records] == [1, 2, 3, 4]
    assert all(r["staleness"] == {"0": 16} for r in records)
    gaps = [r["train"]["logprob_gap"] for r in records]
    assert all(g < 1e-3 for g in gaps), gaps  # transformers' (and PEFT's) Llama and the engine: one model
    assert all(r["train"]["tokens"] > 0 and "loss" in r["train"] for r in records)
    assert_exact(run_dir, steps=4)


def test_the_example_trainer_on_transformers_trains_a_run(tiny_model, digits, tmp_path):
    run_dir = tmp_path / "run"
    example_run(run_dir, tiny_model, digits)
    start = load_file(str(tiny_model / "model.safetensors"))
    end = final_model(run_dir)
    assert any(not torch.equal(start[k], end[k]) for k in start)  # the trainer's updates reached it
    assert not (run_dir / "trainer.json").exists() and not (run_dir / "trainer.key").exists()


def test_trainers_that_fail_come_and_go_and_the_run_ends_as_if_none_had(tiny_model, digits, tmp_path):
    argv = [f"--model.path={tiny_model}", *SYNC, digits, "--flow.steps=5", "--flow.checkpoint_every=2"]
    calm = tmp_path / "calm"
    p = trainer(calm)
    assert main(["train", f"--run-dir={calm}", *argv]) == 0
    assert p.wait(timeout=60) == 0

    run_dir = tmp_path / "run"
    proc = start_cli("train", f"--run-dir={run_dir}", *argv)
    bad = trainer(run_dir, "--nan-at=0")
    out, _ = bad.communicate(timeout=120)
    assert bad.returncode == 3 and "step 0's weights are not all finite" in out, out
    dies = trainer(run_dir, "--die-at=3")  # checkpoints after steps 2 and 4: it dies holding step 3
    out, _ = dies.communicate(timeout=120)
    assert dies.returncode == 9 and "batch 3 replay=False" in out, out
    last = trainer(run_dir)
    out, _ = last.communicate(timeout=120)
    said, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and last.returncode == 0, (said[-3000:], out)
    # it started from step 2's checkpoint and redid step 2 (published by the one that died)
    assert out.splitlines()[0].startswith("start 2 state ") and "batch 2 replay=True publish=False" in out, (
        out
    )
    assert_exact(run_dir, steps=5)
    assert [r["version"] for r in steps(run_dir)] == [1, 2, 3, 4, 5]
    calm_end, end = final_model(calm), final_model(run_dir)
    assert all(torch.equal(calm_end[k], end[k]) for k in calm_end)
    start = load_file(str(tiny_model / "model.safetensors"))
    assert any(not torch.equal(start[k], end[k]) for k in start)


def test_a_run_of_steps_not_a_multiple_of_its_rounds_trains_them_and_publishes_the_last(
    tiny_model, digits, tmp_path
):
    """Sync rounds of two steps; a run of 3 cuts its last round to one step, which publishes, and the
    last checkpoint's model is the trainer's weights after it. (Sync used to finish the round: a 4th
    step, recorded or not depending on a race between the trainer and the run's end.)"""
    run_dir = tmp_path / "run"
    mine = trainer(run_dir, f"--dump={tmp_path}")
    argv = [f"--model.path={tiny_model}", *SYNC, digits, "--flow.steps=3", "--flow.prompts_per_round=8"]
    assert main(["train", f"--run-dir={run_dir}", *argv]) == 0
    out, _ = mine.communicate(timeout=60)
    assert mine.returncode == 0, out
    said = [x for x in out.splitlines() if x.startswith("batch ")]
    assert [x.split()[:4] for x in said] == [
        ["batch", str(s), "replay=False", f"publish={s > 0}"] for s in range(3)
    ], out
    assert len(steps(run_dir)) == 3 and "end steps_done=3 finished=True" in out
    saved = load_file(str(run_dir / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    after = load_file(str(tmp_path / "step_2.safetensors"))
    assert all(torch.equal(saved[k], after[k]) for k in saved)


def test_a_stopped_run_resumes_and_its_next_trainer_starts_from_the_checkpoint(tiny_model, digits, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *SYNC, digits, "--flow.steps=6"
    )
    first = trainer(run_dir)
    wait_for_steps(run_dir, proc, 2)
    proc.send_signal(signal.SIGTERM)
    said, _ = proc.communicate(timeout=60)
    assert "--resume" in said, said[-3000:]
    said_first, _ = first.communicate(timeout=60)
    assert first.returncode == 0, said_first  # the run's end ends its batches, and says it stopped
    assert len(steps(run_dir)) < 6 and "finished=False" in said_first, said_first
    newest = step_dirs(run_dir / "checkpoints")[0]
    done = int(newest.name.removeprefix("step_"))  # the stop may land between a step and its checkpoint
    proc = start_cli("train", "--resume", str(run_dir))
    second = trainer(run_dir)
    out, _ = second.communicate(timeout=120)
    said, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and second.returncode == 0, (said[-3000:], out)
    assert "end steps_done=6 finished=True" in out, out
    # from the newest checkpoint (one per step here), with the optimizer state the first one saved in it
    start = out.splitlines()[0].split()
    assert start[:2] == ["start", str(done)] and int(start[3]) > 0, out
    assert_exact(run_dir, steps=6)


def test_the_example_trainer_trains_a_lora_run_with_peft_and_outlives_its_relay(tiny_model, digits, tmp_path):
    """--train.lora.rank=4: the example trainer builds PEFT's adapter from client.peft_config() on the
    base and publishes the adapter alone; the engines generate with each version of it (the logprob gap
    stays at the two implementations' distance once B is no longer zero). The run's trainer process
    (the relay) SIGKILLed mid-run is replaced as a lost trainer is: the connected trainer is told to
    start again, the next one loads the newest checkpoint's adapter (client.adapter, PEFT's format) and
    optimizer state, and the run ends exact, its last checkpoint holding the merged model too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tailrace.model import lora

    run_dir = tmp_path / "run"
    proc = start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *SYNC, digits, "--flow.steps=5",
        "--train.lora.rank=4", "--train.lr=2e-3",
    )  # fmt: skip
    example = (str(ROOT / "examples" / "external_trainer.py"), str(run_dir))
    first = trainer(run_dir, *example, module=None)
    wait_for_steps(run_dir, proc, 2)
    relay = json.loads((run_dir / "trainer.json").read_text())["pid"]
    os.kill(relay, signal.SIGKILL)
    said_first, _ = first.communicate(timeout=60)
    assert first.returncode != 0 and "start your trainer again" in said_first, said_first
    second = trainer(run_dir, *example, module=None)
    out, _ = second.communicate(timeout=180)
    said, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and second.returncode == 0, (said[-3000:], out)
    assert "the run trained all its steps: 5 steps" in out, out
    start = re.search(r"\(step (\d+), (\d+) state tensors\)", out)  # the newest checkpoint, its state
    assert start and int(start[1]) >= 2 and int(start[2]) > 0, out
    assert recoveries(run_dir), said[-3000:]
    assert_exact(run_dir, steps=5)
    records = steps(run_dir)
    assert all(r["staleness"] == {"0": 16} for r in records)
    gaps = [r["train"]["logprob_gap"] for r in records]
    assert all(g < 1e-3 for g in gaps), gaps  # PEFT's LoRA and the engine's: one model
    last = run_dir / "checkpoints" / "step_000005"
    adapter = lora.load_peft(last / lora.ADAPTER_DIR)
    assert adapter.rank == 4 and any(b.abs().sum() > 0 for _, b in adapter.weights.values())
    assert (last / "model" / "model.safetensors").exists()  # the last checkpoint: merged too
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    PeftModel.from_pretrained(base, str(last / lora.ADAPTER_DIR))  # PEFT reads what the relay saved
    earlier = run_dir / "checkpoints" / "step_000004"
    assert (earlier / lora.ADAPTER_DIR).is_dir() and not (earlier / "model").exists()  # the adapter alone


def test_one_policy_of_two_is_trained_from_outside_the_other_by_tailrace(
    tiny_model, digits, tmp_path, capsys
):
    """Two LoRA tenants on the engines, one trained by a trainer of one's own: its relay builds its model
    on the base the driver shares with the trainers (a bf16 checkpoint's, converted to fp32 once)."""
    tiny_model = as_bf16(tiny_model, tmp_path / "bf16")
    run_dir = tmp_path / "run"
    policies = "[{name: sums}, {name: own, train: {external: true}}]"
    mine = trainer(run_dir / "policies" / "own")  # its relay listens in the policy's own directory
    argv = [f"--model.path={tiny_model}", *TINY_RUN, "--flow.mode=sync", digits, f"--policies={policies}",
            "--train.lora.rank=4"]  # fmt: skip
    assert main(["train", f"--run-dir={run_dir}", *argv]) == 0
    assert "share one copy of the base" in capsys.readouterr().out
    out, _ = mine.communicate(timeout=60)
    assert mine.returncode == 0 and "batch 3 replay=False publish=True" in out, out
    for name, external in (("sums", False), ("own", True)):
        d = run_dir / "policies" / name
        assert_exact(d, steps=4)
        assert [r["version"] for r in steps(d)] == [1, 2, 3, 4]
        assert ("pg_loss" in steps(d)[-1]["train"]) is not external  # the built-in trainer's figure


@pytest.mark.parametrize(
    "flag, said",
    [
        ("--train.world_size=2", "train.external with train.world_size=2"),
    ],
)
def test_what_an_external_trainer_cannot_serve_is_refused_in_one_line(
    capsys, tiny_model, tmp_path, flag, said
):
    run_dir = tmp_path / "run"
    rc, out = run(capsys, "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *SYNC, flag)
    assert rc == 2 and said in one_line(out), out
    assert not (run_dir / "journal.jsonl").exists()


def test_the_example_trainer_trains_a_phi3_lora_run_through_its_fused_modules(
    capsys, tiny_model, digits, tmp_path
):
    """transformers' Phi-3 and PEFT's adapter on its qkv_proj and gate_up_proj (one A per fused module;
    peft_config() names them): the engines, holding q/k/v and gate/up apart, generate what the trainer
    computes, and the checkpoint's adapter is PEFT's own form, which peft loads. A run whose targets
    split a fused module is refused first, in one line."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tailrace.config.train import LORA_TARGETS
    from tailrace.model import lora
    from tailrace.model.checkpoint import read_config

    phi3 = as_phi3(tiny_model, tmp_path / "phi3")
    rc, out = run(capsys, "train", f"--run-dir={tmp_path / 'split'}", f"--model.path={phi3}", *SYNC,
                  "--train.lora.rank=4", "--train.lora.targets=[q_proj, v_proj]")  # fmt: skip
    assert rc == 2 and "PEFT adapts its fused qkv_proj whole" in one_line(out), out
    assert "--train.lora.targets=[q_proj, k_proj, v_proj]" in one_line(out)
    run_dir = tmp_path / "run"
    example_run(run_dir, phi3, digits, "--train.lora.rank=4", "--train.lr=2e-3")
    last = step_dirs(run_dir / "checkpoints")[0] / lora.ADAPTER_DIR
    files = json.loads((last / lora.ADAPTER_CONFIG).read_text())
    assert (files["r"], files["rank_pattern"]) == (4, {}) and "qkv_proj" in files["target_modules"]
    adapter = lora.load_peft(last, read_config(phi3))
    assert {t for _, t in adapter.weights} == set(LORA_TARGETS)  # each projection, one A per fused module
    assert any(b.abs().sum() > 0 for _, b in adapter.weights.values())  # the trainer moved it
    base = AutoModelForCausalLM.from_pretrained(phi3, dtype=torch.float32)
    PeftModel.from_pretrained(base, str(last))  # PEFT reads what the relay saved
