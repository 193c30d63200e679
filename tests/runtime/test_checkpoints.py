"""Checkpoints: every `model/` a complete HF checkpoint, optimizer state in safetensors, sizes recorded
and printed, one file mode throughout the run directory."""

import json
import stat

import pytest

from tailrace.cli import main
from tests.runtime.conftest import CHAT_TEMPLATE, checkpoints, copy_run

pytestmark = pytest.mark.slow


def test_every_checkpoint_model_is_a_complete_hf_checkpoint(finished_run, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpts = checkpoints(finished_run)
    assert [c.name for c in ckpts] == ["step_000002", "step_000003", "step_000004"]
    for c in ckpts:
        model = c / "model"
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (model / name).is_file(), name
        assert AutoModelForCausalLM.from_pretrained(model).num_parameters() > 0
        assert AutoTokenizer.from_pretrained(model).chat_template == CHAT_TEMPLATE
    rc = main(["eval", f"--model.path={ckpts[-1] / 'model'}", "--eval.n=4", "--eval.max_new_tokens=16"])
    out = capsys.readouterr().out
    assert rc == 0 and "held-out accuracy" in out


def test_optimizer_state_is_safetensors_and_no_pickle_is_written(finished_run):
    from safetensors import safe_open

    newest = checkpoints(finished_run)[-1]
    assert not list(finished_run.rglob("*.pt")) and not list(finished_run.rglob("*.bin"))
    with safe_open(str(newest / "optimizer.safetensors"), framework="pt") as f:
        assert any(k.endswith("exp_avg_sq") for k in f.keys())
    assert json.loads((newest / "scheduler.json").read_text())["steps_done"] == 4


def test_checkpoint_sizes_are_recorded_and_reported(finished_run, tmp_path, capsys):
    records = [json.loads(l) for l in (finished_run / "metrics.jsonl").read_text().splitlines()]
    saved = [r for r in records if r["kind"] == "checkpoint"]
    assert [r["step"] for r in saved] == [1, 2, 3, 4]
    newest = checkpoints(finished_run)[-1]
    on_disk = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    assert saved[-1]["bytes"]["total"] == on_disk
    assert saved[-1]["bytes"]["optimizer"] == (newest / "optimizer.safetensors").stat().st_size
    assert saved[-1]["seconds"] >= 0
    run = copy_run(finished_run, tmp_path / "run")
    assert main(["report", str(run)]) == 0
    assert (
        f"4 checkpoints, the last after step 4: {on_disk / 1e6:.1f} MB" in (run / "report.html").read_text()
    )


def test_every_file_of_a_run_has_one_mode(finished_run):
    modes = {stat.S_IMODE(f.stat().st_mode) for f in finished_run.rglob("*") if f.is_file()}
    assert len(modes) == 1, {oct(m) for m in modes}
