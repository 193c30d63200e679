"""Bad input ends in one clear line (exit code 2) that names the problem and the fix."""

import json

import pytest

from tests.runtime.conftest import run


def test_missing_checkpoint(capsys, tmp_path):
    rc, out = run(capsys, "eval", f"--model.path={tmp_path / 'nope'}")
    assert rc == 2 and len(out.splitlines()) == 1
    assert "nope" in out and "not a directory" in out and "config.json" in out


def test_brackets_in_a_message_are_printed(capsys, tmp_path):
    rc, out = run(capsys, "eval", f"--model.path={tmp_path / 'x[model]'}")
    assert rc == 2 and len(out.splitlines()) == 1 and "x[model]" in out


def test_corrupt_checkpoint(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    rc, out = run(capsys, "eval", f"--model.path={tmp_path}")
    assert rc == 2 and len(out.splitlines()) == 1 and "config.json" in out


def test_unknown_task(capsys, tmp_path):
    rc, out = run(capsys, "train", "--task.name=chainsumm", f"--run-dir={tmp_path / 'r'}", "--model.path=/x")
    assert rc == 2 and len(out.splitlines()) == 1 and "chainsumm" in out
    assert "chainsum" in out and "gym:" in out


def test_malformed_jsonl_line(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n{oops\n")
    from tailrace.tasks.base import TaskError
    from tailrace.tasks.registry import make_task

    with pytest.raises(TaskError) as e:
        make_task(f"jsonl:{data}")
    msg = str(e.value)
    assert "d.jsonl:2:" in msg and "JSON" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--flow.stepz=3"], "flow.steps"),
        (["--flow.steps=abc"], "flow.steps"),
        (["--flow.train_batch=100"], "train_batch"),
        (["--train.lr=-1"], "lr"),
        (["--rollout.temperature=0"], "temperature"),
        (["--rollout.attention=flash"], "rollout.attention"),
        (["--flow.mode=pip"], "multiversion"),
        (["--train.loss.name=ppo"], "drgrpo"),
        (["--flow.mode=async", "--flow.max_staleness=0"], "max_staleness"),
        (["--rollout.top_k=-5"], "rollout.top_k"),
        (["--train.lr=inf"], "train.lr"),
        (["--train.loss.kl_coef=nan"], "train.loss.kl_coef"),
        (["--train.loss.eps_high=inf"], "train.loss.eps_high"),
    ],
)
def test_bad_config_is_rejected_before_anything_starts(capsys, tmp_path, args, needle):
    rc, out = run(capsys, "train", f"--run-dir={tmp_path / 'r'}", *args)
    assert rc == 2 and len(out.splitlines()) == 1 and needle in out
    assert not (tmp_path / "r").exists(), "a rejected config must not create a run directory"


def as_vllm_run(run):
    """`run` as if it had rolled out on vLLM: rollout.backend=vllm in its config.yaml and each
    checkpoint's (the checkpoint manifest's sizes follow)."""
    from tailrace.runtime.checkpoint import MANIFEST
    from tests.runtime.conftest import checkpoints

    for d in [run, *checkpoints(run)]:
        cfg = d / "config.yaml"
        cfg.write_text(cfg.read_text().replace("backend: tailrace", "backend: vllm", 1))
        if (d / MANIFEST).is_file():
            man = json.loads((d / MANIFEST).read_text())
            man["files"]["config.yaml"] = cfg.stat().st_size
            (d / MANIFEST).write_text(json.dumps(man))
    return run


def test_a_vllm_run_s_directory_is_read_where_vllm_is_not_installed(capsys, finished_run, tmp_path):
    """Trained on a GPU box with vLLM, evaluated on a laptop without it: `tailrace eval RUN` reads its
    checkpoints and evaluates them on tailrace's engine, saying so; only what rolls out on vLLM asks
    for it."""
    import importlib.util

    from tests.runtime.conftest import copy_run

    run_dir = as_vllm_run(copy_run(finished_run, tmp_path / "run"))
    rc, out = run(capsys, "eval", str(run_dir), "--eval.n=8", "--eval.max_new_tokens=16")
    assert rc == 0 and "not whole" not in out, out
    assert out.count("held-out accuracy") == 3  # the three kept checkpoints
    if importlib.util.find_spec("vllm") is not None:
        return
    assert out.count("evaluating on tailrace's engine (the run rolled out on vLLM)") == 3
    rc, out = run(capsys, "train", "--rollout.backend=vllm", f"--run-dir={tmp_path / 'new'}")
    assert rc == 2 and len(out.splitlines()) == 1 and not (tmp_path / "new").exists()
    assert "vLLM is not installed" in out and "rollout.backend=tailrace" in out
    rc, out = run(capsys, "train", "--supervise", "--rollout.backend=vllm", f"--run-dir={tmp_path / 'new'}")
    assert rc == 2 and "vLLM is not installed" in out
