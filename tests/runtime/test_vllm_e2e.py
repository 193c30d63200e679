"""`tailrace train --rollout.backend=vllm` end to end through real processes, on a tiny warm-started
model whose heads vLLM's CPU attention takes (head size 32). Needs vLLM: skipped where it does not
import (CI); `make test-vllm` runs it."""

import json

import pytest

pytest.importorskip("vllm")

from tailrace.records import Finished, read_journal  # noqa: E402
from tests.runtime.conftest import TINY_ARCH, TINY_RUN, TINY_SFT, run  # noqa: E402

run_cli = run


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    from tailrace.config import ArchConfig, SFTConfig
    from tailrace.runtime.warmstart import build_warm_start

    out = tmp_path_factory.mktemp("tiny32") / "model"
    build_warm_start(
        ArchConfig(**{**TINY_ARCH, "num_heads": 2, "num_kv_heads": 1}), SFTConfig(**TINY_SFT), out
    )
    return out


def test_a_sync_run_on_vllm_trains_every_step_on_its_own_versions(tiny32, tmp_path, capfd):
    """Four steps: each trains samples of the version before it (sync: on-policy), every token of a
    trajectory carries its dispatch version, and vLLM's logprobs agree with the fp32 trainer's. (capfd:
    the engine process says what it runs on.)"""
    rc, out = run(capfd, "train", f"--run-dir={tmp_path / 'r'}", f"--model.path={tiny32}", *TINY_RUN,
                  "--rollout.backend=vllm", "--train.loss.kl_coef=0.01")  # fmt: skip
    assert rc == 0, out
    assert "engine 0: vLLM 0.32" in out
    recs = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
    assert all(
        0 <= s["train"]["logprob_gap_mean"] < 1e-4 and s["train"]["logprob_gap_max"] < 1e-2 for s in steps
    )
    trajs = [e.trajectory for e in read_journal(tmp_path / "r" / "journal.jsonl") if isinstance(e, Finished)]
    assert len(trajs) >= 4 * 16
    assert all(set(t.versions) == {t.dispatch_version} for t in trajs if t.versions)


@pytest.mark.parametrize("mode", [["--flow.mode=partial"], ["--flow.mode=multiversion"]])
def test_modes_a_one_version_engine_cannot_serve_are_refused_before_anything_starts(tmp_path, capsys, mode):
    rc, out = run(capsys, "train", f"--run-dir={tmp_path / 'r'}", "--model.path=/nowhere", "--rollout.backend=vllm",
                  *mode)  # fmt: skip
    assert rc == 2 and len(out.splitlines()) == 1
    assert "one weight version at a time" in out and "flow.placement=dedicated" in out


def test_two_lora_policies_train_on_one_vllm_engine_in_multiversion(tiny32, tmp_path, digits, capfd):
    """A LoRA run on vLLM: each version of each policy is an adapter over the base vLLM loaded once
    (vLLM's LoRA), so the engine holds several versions and multiversion runs on it. Both policies
    train every step, and vLLM's logprobs agree with each trainer's under its own adapter."""
    from tests.runtime.test_lora_e2e import LORA, gaps_small, step_records

    run = tmp_path / "r"
    policies = "[{name: sums}, {name: other, seed: 7, flow: {mode: pipe}}]"
    rc, out = run_cli(capfd, "train", f"--run-dir={run}", f"--model.path={tiny32}", *TINY_RUN, *LORA, digits,
                      "--rollout.backend=vllm", "--flow.mode=multiversion", f"--policies={policies}")  # fmt: skip
    assert rc == 0, out
    assert "LoRA up to rank 8" in out
    for name in ("sums", "other"):
        steps = step_records(run / "policies" / name)
        assert len(steps) == 4 and steps[-1]["ledger"]["trained"] == 32 * 4
        assert gaps_small(steps), [s["train"]["logprob_gap_max"] for s in steps]
    trajs = [
        e.trajectory
        for e in read_journal(run / "policies" / "sums" / "journal.jsonl")
        if isinstance(e, Finished)
    ]
    assert len({t.dispatch_version for t in trajs}) > 1


def test_two_policies_on_vllm_engines_each_serving_one_of_them(tiny32, tmp_path, capfd):
    """Whole weights on one-version vLLM engines: engine k serves policy k (each holds one set of
    weights), the held-out evaluations load each policy's weights in turn; both policies end exact,
    sampled under their own weights (vLLM's logprobs agree with each trainer's at every step: the KL
    penalty makes every step compute)."""
    from tests.runtime.conftest import assert_exact
    from tests.runtime.test_lora_e2e import step_records

    run = tmp_path / "r"
    rc, out = run_cli(capfd, "train", f"--run-dir={run}", f"--model.path={tiny32}", *TINY_RUN,
                      "--train.loss.kl_coef=0.01", "--rollout.backend=vllm", "--rollout.engines=2", "--flow.mode=sync",
                      "--policies=[{name: a}, {name: b, seed: 7, flow: {mode: pipe}}]")  # fmt: skip
    assert rc == 0, out
    assert out.count("vLLM 0.32") >= 2
    for name in ("a", "b"):
        assert_exact(run / "policies" / name, steps=4)
        steps = step_records(run / "policies" / name)
        assert all(s["train"]["logprob_gap_max"] < 1e-2 for s in steps), steps


@pytest.mark.parametrize(
    "weights,extra",
    [
        ("collective", ["--flow.mode=sync"]),
        ("object_store", ["--flow.mode=multiversion", "--train.lora.rank=4"]),
    ],
)
def test_vllm_engines_as_ray_actors(tiny32, tmp_path, capfd, weights, extra):
    """`runtime.kind=ray` with vLLM engines: whole weights broadcast by a collective into vLLM, and LoRA
    adapters through the object store in multiversion. Every step trains, and vLLM's logprobs agree
    with the trainer's, so the weights each version was sampled under are the trainer's."""
    import logging

    ray = pytest.importorskip("ray")
    from tests.runtime.test_lora_e2e import gaps_small, step_records

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
    try:
        rc, out = run_cli(capfd, "train", f"--run-dir={tmp_path / 'r'}", f"--model.path={tiny32}", *TINY_RUN,
                          "--rollout.backend=vllm", "--runtime.kind=ray", f"--runtime.weights={weights}",
                          "--train.loss.kl_coef=0.01", *extra)  # fmt: skip
    finally:
        ray.shutdown()
    assert rc == 0, out
    assert "engine 0: vLLM 0.32" in out
    steps = step_records(tmp_path / "r")
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
    assert gaps_small(steps), [s["train"]["logprob_gap_max"] for s in steps]
    assert all(s["time"]["weight_sync_s"] > 0 for s in steps)


def test_tailrace_eval_of_a_vllm_lora_run_reproduces_its_final_evaluation(tiny32, tmp_path, digits, capfd):
    """`tailrace eval RUN` evaluates on the engine the run's own evaluations used: vLLM, a checkpoint's
    adapter as vLLM's LoRA over the base. The last checkpoint gives the run's final figures exactly
    (the same prompts and seeds); the earlier ones (their adapter alone) are evaluated too."""
    from tests.runtime.test_lora_e2e import LORA

    run = tmp_path / "r"
    rc, out = run_cli(capfd, "train", f"--run-dir={run}", f"--model.path={tiny32}", *TINY_RUN, *LORA, digits,
                      "--rollout.backend=vllm", "--flow.mode=sync", "--eval.n=32")  # fmt: skip
    assert rc == 0, out
    rc, out = run_cli(capfd, "eval", str(run))
    assert rc == 0 and "vLLM 0.32" in out and "tailrace's engine" not in out, out
    evals = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line
    ]
    (final,) = [e for e in evals if e["tag"] == "final"]
    ckpts = {e["step"]: e for e in evals if e["tag"] == "checkpoint"}
    assert sorted(ckpts) == [3, 4]  # the two kept (step 3's: its adapter alone)
    same = ("accuracy", "n", "p50", "p99", "mean")
    assert {k: ckpts[4][k] for k in same} == {k: final[k] for k in same}
