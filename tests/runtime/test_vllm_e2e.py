"""`tailrace train --rollout.backend=vllm` end to end through real processes, on a tiny warm-started
model whose heads vLLM's CPU attention takes (head size 32). Needs vLLM: skipped where it does not
import (CI); `make test-vllm` runs it."""

import json

import pytest

pytest.importorskip("vllm")

from tailrace.records import Finished, read_journal  # noqa: E402
from tests.runtime.conftest import TINY_ARCH, TINY_RUN, TINY_SFT, run  # noqa: E402


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
