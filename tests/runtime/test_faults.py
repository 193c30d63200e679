"""Faults while a run goes: a worker that dies, stops, or raises; training that goes non-finite;
signals; a full disk. Each ends in one line with the cause and the fix — exit code 2 for bad input,
3 for a fault, 130/143 for Ctrl-C/SIGTERM — never a traceback or a hang."""

import ctypes
import errno
import os
import resource
import shutil
import signal
import time

import pytest

from tests.runtime.conftest import (
    TINY_RUN,
    checkpoints,
    copy_run,
    one_line,
    run,
    start_cli,
    unfinish,
    wait_for_steps,
    workers_of,
)

pytestmark = pytest.mark.slow


def finish(p, timeout=120):
    """The process's exit code and output; it must end within `timeout` seconds."""
    try:
        out, _ = p.communicate(timeout=timeout)
    except Exception:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return p.returncode, out


def long_run(tiny_model, run_dir, *extra):
    return start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.steps=200", *extra
    )


def test_a_dead_worker_is_one_line_without_restarts(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    p = long_run(tiny_model, run_dir, "--max_restarts=0")  # with restarts: tests/runtime/test_recovery.py
    wait_for_steps(run_dir, p, 2)  # the first step's checkpoint is whole by then
    trainer, engine = workers_of(p.pid)
    os.kill(engine, signal.SIGKILL)
    rc, out = finish(p)
    line = one_line(out)
    assert rc == 3, out
    assert "engine0" in line and "died" in line and "SIGKILL" in line and "--resume" in line
    # a SIGKILL is most likely the out-of-memory killer: what the run holds, and what needs less
    assert "GiB of published weights in shared memory (4 versions)" in line, line
    assert (
        "try --train.lora.rank=8" in line and "--flow.mode=sync" in line and "--model.dtype=bfloat16" in line
    )


def damage(model, how):
    if how == "corrupt":
        w = model / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    else:  # weights that do not match config.json
        cfg = (model / "config.json").read_text()
        (model / "config.json").write_text(cfg.replace('"intermediate_size": 128', '"intermediate_size": 96'))


@pytest.mark.parametrize("how", ["corrupt", "mismatch"])
def test_a_worker_that_cannot_load_its_model_is_one_line(tiny_model, tmp_path, capsys, how):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    damage(model, how)
    rc, out = run(capsys, "train", f"--run-dir={tmp_path / 'run'}", f"--model.path={model}", *TINY_RUN)
    lines = out.splitlines()  # the start-up lines (run directory, learning rate), then the error
    assert rc == 2 and lines[-1].startswith("error: ") and "Traceback" not in out, out
    assert not any(x.startswith("error") for x in lines[:-1]), out
    assert "model.safetensors" in out if how == "corrupt" else "config.json" in out


def test_non_finite_training_stops_before_anything_is_published(tiny_model, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # a trained temperature this small turns every logit infinite: the very first loss is nan (the KL
    # penalty makes the trainer compute it even when every group's rewards are equal)
    rc, out = run(capsys, "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN,
                  "--train.temperature=1e-45", "--train.loss.kl_coef=0.01")  # fmt: skip
    line = out.splitlines()[-1]
    assert rc == 3, out
    assert "finite" in line and "train.lr" in line
    assert '"kind":"step"' not in (run_dir / "metrics.jsonl").read_text()
    assert not checkpoints(run_dir)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_is_the_friendly_line(tiny_model, tmp_path, sig, code):
    if sig == signal.SIGINT and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # a shell starts background jobs (`cmd &`) with SIGINT ignored, and children inherit that: the
        # run is then deaf to Ctrl-C by its parent's choice, as a shell user would want
        pytest.skip("SIGINT is ignored in this process (started in the background); its children inherit it")
    run_dir = tmp_path / "run"
    p = long_run(tiny_model, run_dir)
    wait_for_steps(run_dir, p, 2)  # the first step's checkpoint is whole by then
    workers = workers_of(p.pid)
    # SIGTERM as a service manager sends it (to the driver); SIGINT as a terminal's Ctrl-C (to the group)
    os.kill(p.pid, sig) if sig == signal.SIGTERM else os.killpg(p.pid, sig)
    rc, out = finish(p)
    line = one_line(out)
    assert rc == code, out
    assert "--resume" in line and str(run_dir) in line
    time.sleep(0.5)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}")], "workers outlived the run"


def test_a_full_shared_memory_is_one_line(tiny_model, tmp_path):
    limit = (tiny_model / "model.safetensors").stat().st_size  # smaller than the weights ring

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as when full
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run_dir = tmp_path / "run"
    p = start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, preexec_fn=small_files
    )
    rc, out = finish(p)
    line = one_line(out)
    assert rc == 3, out
    assert "shared memory" in line and "File too large" in line and "/dev/shm" in line


def test_a_full_disk_is_one_line(tiny_model, tmp_path, capsys, monkeypatch):
    from tailrace.runtime.rundir import RecordFile

    write = RecordFile.write

    def full_after_two_steps(self, record):
        if self.path.name == "metrics.jsonl" and self.path.read_text().count('"kind":"step"') >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, record)

    monkeypatch.setattr(RecordFile, "write", full_after_two_steps)
    run_dir = tmp_path / "run"
    rc, out = run(capsys, "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN)
    line = out.splitlines()[-1]
    assert rc == 3, out
    assert "No space left on device" in line and f"--resume {run_dir}" in line
    assert "Traceback" not in out


def drop_root_override() -> None:
    """In a child about to exec: root without CAP_DAC_OVERRIDE (1) and CAP_DAC_READ_SEARCH (2) obeys
    file modes, as any user does (prctl PR_CAPBSET_DROP = 24)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        assert libc.prctl(24, cap, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())


def test_a_read_only_run_directory_is_one_line(finished_run, tmp_path):
    run_dir = unfinish(copy_run(finished_run, tmp_path / "run"))
    paths = [run_dir, *run_dir.rglob("*")]
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        p = start_cli(
            "train", f"--resume={run_dir}", preexec_fn=drop_root_override if os.geteuid() == 0 else None
        )
        rc, out = finish(p)
    finally:
        for p in paths:
            p.chmod(0o755 if p.is_dir() else 0o644)
    line = one_line(out)
    assert rc == 2, out
    assert str(run_dir) in line and "writable" in line
