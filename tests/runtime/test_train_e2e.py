"""End to end through real processes: determinism of sync mode, and kill -9 then --resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tailrace.cli import main
from tailrace.records import Finished, read_journal
from tests.runtime.conftest import TINY_RUN


def steps_of(run: Path) -> list[dict]:
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in recs if r["kind"] == "step"]


def finished(run: Path) -> list[tuple[int, int]]:
    """(group, sample index) of every finished trajectory in the run's journal."""
    journal = read_journal(run / "journal.jsonl")
    return [(e.trajectory.group, e.trajectory.sample_index) for e in journal if isinstance(e, Finished)]


def test_sync_with_a_fixed_seed_gives_identical_metrics_with_or_without_periodic_eval(tiny_model, tmp_path):
    """Run b also evaluates every 2nd step's weights (after training) and keeps every checkpoint:
    its training is the same, and `tailrace eval RUN_DIR` then evaluates its checkpoints."""
    # the tiny model earns no reward: a small KL penalty makes every step move the weights
    runs, extra = [], {"a": [], "b": ["--eval.every=2", "--flow.keep_checkpoints=4"]}
    for name in ("a", "b"):
        argv = [
            "train",
            f"--run-dir={tmp_path / name}",
            f"--model.path={tiny_model}",
            *TINY_RUN,
            "--flow.mode=sync",
        ]
        assert main([*argv, "--train.loss.kl_coef=0.01", *extra[name]]) == 0
        runs.append([{k: v for k, v in r.items() if k != "time"} for r in steps_of(tmp_path / name)])
    assert len(runs[0]) == 4
    assert runs[0] == runs[1]
    assert any(
        r["length"]["mean"] != runs[0][0]["length"]["mean"]
        or r["train"]["entropy"] != runs[0][0]["train"]["entropy"]
        for r in runs[0][1:]
    ), "steps should differ from each other (the test would be vacuous)"
    check_periodic_and_checkpoint_evals(tmp_path / "b")


def test_bf16_engines_get_a_bf16_ring_and_train_as_with_an_fp32_one(tiny_model, tmp_path, monkeypatch):
    """bf16 engines and the built-in full fine-tune: the ring holds bf16, half the memory. A version
    is rounded once as it is written, as an engine rounds an fp32 one as it loads it: every step and
    the periodic evaluation are those of a run whose ring holds fp32."""
    from safetensors.torch import load_file

    from tailrace.runtime.driver import Driver

    real, runs, rings = Driver._ring_dtype, [], []
    for name, forced in (("half", None), ("full", torch.float32)):

        def ring_dtype(self, forced=forced):
            rings.append(forced or real(self))
            return rings[-1]

        monkeypatch.setattr(Driver, "_ring_dtype", ring_dtype)
        argv = ["train", f"--run-dir={tmp_path / name}", f"--model.path={tiny_model}", *TINY_RUN]
        extra = ["--flow.mode=sync", "--model.dtype=bfloat16", "--train.loss.kl_coef=0.01", "--eval.every=2"]
        assert main([*argv, *extra]) == 0
        records = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        timeless = [{k: v for k, v in r.items() if k not in ("time", "wall_s")} for r in records]
        runs.append([r for r in timeless if r["kind"] in ("step", "eval")])
    assert rings == [torch.bfloat16, torch.float32]
    assert runs[0] == runs[1] and len(runs[0]) > 4
    snaps = sorted((tmp_path / "half" / "snapshots").glob("*.safetensors"))
    assert snaps and load_file(str(snaps[0]))["flat"].dtype == torch.bfloat16


def check_periodic_and_checkpoint_evals(run):
    from safetensors.torch import load_file

    from tailrace.model.checkpoint import load_pretrained
    from tailrace.model.flat import flatten_parameters
    from tailrace.runtime.checkpoint import step_dir

    steps = {r["step"] + 1: r for r in steps_of(run)}
    evals = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"kind":"eval"' in l]
    periodic = [e for e in evals if e["tag"] == "periodic"]
    assert [e["step"] for e in periodic] == [2]  # step 4's weights are the final evaluation's
    (p,) = periodic
    assert p["version"] == steps[2]["version"] and p["wall_s"] == steps[2]["time"]["wall_s"]
    assert p["n"] == 16 and 0.0 <= p["accuracy"] <= 1.0
    buckets = p["by_difficulty"]  # chainsum's, by terms
    assert sum(b["n"] for b in buckets.values()) == 16 and set(buckets) <= {"2-4", "5-10", "11+"}
    # the snapshot evaluated is exactly the model the step-2 checkpoint saved
    snap = load_file(str(run / "snapshots" / f"v{p['version']:06d}.safetensors"))["flat"]
    saved = flatten_parameters(load_pretrained(step_dir(run / "checkpoints", 2) / "model")).buffer
    assert torch.equal(saved, snap)

    assert main(["eval", str(run), "--eval.n=16"]) == 0
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    ckpts = [e for e in records if e.get("tag") == "checkpoint"]
    assert [e["step"] for e in ckpts] == [1, 2, 3, 4]
    assert all(e["version"] == steps[e["step"]]["version"] for e in ckpts)
    assert all(e["wall_s"] == steps[e["step"]]["time"]["wall_s"] for e in ckpts)
    assert main(["eval", str(run)]) == 0  # a second time: nothing left to evaluate, nothing appended
    assert len((run / "metrics.jsonl").read_text().splitlines()) == len(records)


def test_kill_9_then_resume_repeats_no_step_and_loses_no_trajectory(tiny_model, tmp_path):
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "tailrace.cli",
        "train",
        f"--run-dir={run}",
        f"--model.path={tiny_model}",
        *TINY_RUN,
        "--flow.steps=8",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(
        args, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 240
    while time.time() < deadline and (not (run / "metrics.jsonl").exists() or len(steps_of(run)) < 3):
        assert p.poll() is None, p.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)  # the whole run: driver, trainer and engine processes
    p.wait()
    killed_at = len(steps_of(run))
    assert 3 <= killed_at < 8
    done_before = finished(run)

    resumed = subprocess.run(
        [sys.executable, "-m", "tailrace.cli", "train", f"--resume={run}"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    steps = [r["step"] for r in steps_of(run)]
    assert steps == list(range(8)), f"steps after resume: {steps}"
    # the run's clock goes on across the resume (time to accuracy reads it): never back to zero
    walls = [r["time"]["wall_s"] for r in steps_of(run)]
    assert walls == sorted(walls) and walls[killed_at] > walls[killed_at - 1], walls
    assert all(0 <= r["time"]["trainer_wait_ratio"] <= 1 for r in steps_of(run))
    done = finished(run)
    assert len(done) == len(set(done)), "a finished trajectory was generated twice"
    assert set(done_before) <= set(done)
    final = steps_of(run)[-1]["ledger"]
    discarded = sum(final["discarded"].values())
    assert final["trained"] == 8 * 16
    assert final["produced"] >= len(done_before)
    assert final["produced"] == final["trained"] + final["in_store"] + discarded
    lost = {k: v for k, v in final["discarded"].items() if k != "zero-signal"}  # replaced on purpose
    assert not lost, f"with a checkpoint per step nothing may be discarded: {final['discarded']}"


@pytest.mark.parametrize("drafter", ["history", "trained"])
def test_speculation_changes_no_recorded_figure_but_time(tiny_model, tmp_path, drafter):
    """Sync, one seed, with and without a drafter (toggle off: every decode row drafts; siblings feed
    the history drafter; the trained one learns while its engine waits for the trainer): every step
    record is identical but for `time`, which carries the drafts, per version too."""
    runs = []
    for name, spec in (
        ("off", []),
        ("spec", [f"--rollout.spec.drafter={drafter}", "--rollout.spec.toggle=false"]),
    ):
        argv = [
            "train",
            f"--run-dir={tmp_path / name}",
            f"--model.path={tiny_model}",
            *TINY_RUN,
            "--flow.mode=sync",
        ]
        rc = main([*argv, *spec])
        assert rc == 0
        runs.append(steps_of(tmp_path / name))
    strip = [[{k: v for k, v in r.items() if k != "time"} for r in run] for run in runs]
    assert strip[0] == strip[1]
    assert "spec_drafted" not in runs[0][0]["time"]
    t = [r["time"] for r in runs[1]]
    assert sum(x["spec_drafted"] for x in t) > 0 and sum(x["spec_accepted"] for x in t) > 0
    assert all(0 < x["spec_forwards_per_token"] <= 1 for x in t)
    for r, x in zip(runs[1], t):  # sync: a step's samples are of the version before it
        assert set(x["spec_by_version"]) <= {str(r["version"] - 1)}
    if drafter == "trained":
        assert sum(x["spec_train_steps"] for x in t) > 0 and all(x["spec_train_step_s"] >= 0 for x in t)


def test_a_data_parallel_trainer_trains_like_one_process(tiny_model, tmp_path):
    """train.world_size=2: two gloo ranks share each step's rows; the first step's metrics (same
    weights, same samples) are the one-process run's, summed over both ranks, and the run ends whole.
    The tiny model earns no reward, so a KL penalty makes every step compute."""
    import glob
    import tempfile

    def rendezvous() -> set[str]:
        return set(glob.glob(f"{tempfile.gettempdir()}/tailrace-ranks-*"))

    before, losses = rendezvous(), {}
    for world in (1, 2):
        run = tmp_path / f"w{world}"
        argv = [
            "train",
            f"--run-dir={run}",
            f"--model.path={tiny_model}",
            *TINY_RUN,
            "--flow.steps=2",
            "--eval.n=4",
        ]
        dp = [f"--train.world_size={world}", "--train.micro_batch_tokens=256", "--train.loss.kl_coef=0.1"]
        assert main([*argv, *dp, "--flow.zero_signal=train"]) == 0
        losses[world] = [(s["train"]["entropy"], s["train"]["tokens"]) for s in steps_of(run)]
    (ent1, tok1), (ent2, tok2) = losses[1][0], losses[2][0]
    assert tok2 == tok1 > 0 and ent2 == pytest.approx(ent1, rel=1e-5)
    assert len(losses[2]) == 2
    assert rendezvous() <= before  # the ranks' spec and rendezvous file are removed once they finish


def test_bubble_pre_generation_drafts_the_next_round_and_trains_nothing_of_it(tiny_model, tmp_path):
    """rollout.spec.pregen_below=1: every round but the last hands the next round's prompts to idle
    slots; the run trains exactly its samples and its ledger counts none of the pre-generated ones."""
    run = tmp_path / "run"
    argv = [
        "train",
        f"--run-dir={run}",
        f"--model.path={tiny_model}",
        *TINY_RUN,
        "--flow.steps=3",
        "--eval.n=4",
    ]
    spec = ["--rollout.spec.drafter=history", "--rollout.spec.pregen_below=1.0", "--flow.zero_signal=train"]
    assert main([*argv, *spec]) == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    pregen = [e for e in events if e.get("kind") == "pregen"]
    opened = [json.loads(line) for line in (run / "journal.jsonl").read_text().splitlines()]
    opened = [j["prompt"]["id"] for j in opened if j["kind"] == "open"]
    by_version = {}
    for e in pregen:  # handed out as slots free up
        by_version.setdefault(e["version"], []).extend(e["prompts"])
    assert sorted(by_version) == [0, 1]  # rounds 1 and 2 (round 3 is the last: nothing after it)
    assert by_version[0] and set(by_version[0]) <= set(opened[4:8])  # round 2's prompts, drafted in round 1
    assert by_version[1] and set(by_version[1]) <= set(opened[8:12])
    last = steps_of(run)[-1]["ledger"]
    assert last["trained"] == last["produced"] == 3 * 16


def test_pre_generation_needs_the_history_drafter():
    from tailrace.config import load_config

    with pytest.raises(Exception, match="rollout.spec.pregen_below=0.5.*drafter=history"):
        load_config(None, ["--rollout.spec.pregen_below=0.5"])


def test_the_default_run_is_multiversion_with_its_own_correction_and_says_so(tiny_model, tmp_path, capsys):
    """flow.mode null: the recommended mode (multiversion, K = 1, behaviour correction), printed with
    the reason, written to config.yaml (a resume runs it again), and every sample at most 1 stale."""
    from tests.runtime.conftest import run

    rc, out = run(capsys, "train", f"--run-dir={tmp_path / 'r'}", f"--model.path={tiny_model}", *TINY_RUN)
    assert rc == 0, out[-2000:]
    assert "mode multiversion (flow.mode null: the best measured wall time" in out
    assert "off-policy correction behaviour" in out
    assert "mode: multiversion" in (tmp_path / "r" / "config.yaml").read_text()
    steps = steps_of(tmp_path / "r")
    assert len(steps) == 4 and all(set(s["staleness"]) <= {"0", "1"} for s in steps)
