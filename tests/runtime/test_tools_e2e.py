"""A multi-turn tool task end to end through real processes (sync, and the default multiversion): tool
calls park and continue, observations are in the trajectories and masked, the ledger is exact, the
record shows the waits."""

from __future__ import annotations

import json

import pytest

from tailrace.cli import main
from tailrace.records import Finished, read_journal
from tailrace.tokenizer import char_tokenizer
from tests.runtime.conftest import TINY_RUN


@pytest.mark.parametrize("mode", ["sync", None])  # None: flow.mode null, the recommended multiversion
def test_chaincalc_trains_with_tool_calls_and_an_exact_ledger(tool_model, tmp_path, mode):
    run = tmp_path / "run"
    argv = ["train", f"--run-dir={run}", f"--model.path={tool_model}", "--task.name=chaincalc", *TINY_RUN]
    argv = [a for a in argv if not a.startswith("--rollout.max_new_tokens")] + ["--rollout.max_new_tokens=96"]
    argv += [f"--flow.mode={mode}"] if mode else []
    assert main([*argv, "--task.config={tools: [calc, py]}", "--eval.max_new_tokens=96"]) == 0
    assert f"mode: {mode or 'multiversion'}" in (run / "config.yaml").read_text()
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    assert len(steps) == 4
    for r in steps:
        led = r["ledger"]
        assert led["produced"] == led["trained"] + led["in_store"] + sum(led["discarded"].values())
        assert {"calls", "turns_mean", "observed_tokens", "errors"} <= set(r["tools"])
        assert "tool_wait_s" in r["time"] and r["time"]["tool_wait_max_s"] >= 0
    assert sum(r["tools"]["calls"] for r in steps) > 0, "the fine-tuned tiny model should call the calculator"
    tok = char_tokenizer()
    trajs = [e.trajectory for e in read_journal(run / "journal.jsonl") if isinstance(e, Finished)]
    called = [t for t in trajs if t.observed]
    assert called
    for t in called:
        ids = t.result.token_ids
        for a, b in t.observed:
            assert tok.decode(ids[:a]).endswith("]") and tok.decode(ids[a:b]).startswith("=")
            assert all(lp == 0.0 for lp in t.result.logprobs[a:b])
    assert all(
        r["train"]["gap_tokens"] <= r["train"]["tokens"] + r["train"].get("stale_tokens", 0) for r in steps
    )


def test_calls_near_the_context_limit_are_cut_never_overflow_it(tool_model, tmp_path):
    """A context barely longer than the prompts: answers are cut to fit, calls with no room left are
    scored as they stand, and the engine is never handed a request beyond its context."""
    run = tmp_path / "run"
    argv = ["train", f"--run-dir={run}", f"--model.path={tool_model}", "--task.name=chaincalc", *TINY_RUN]
    argv = [a for a in argv if not a.startswith(("--flow.steps", "--rollout.max_new_tokens"))]
    extra = ["--flow.steps=2", "--rollout.max_new_tokens=96", "--rollout.max_context=72"]
    assert main([*argv, *extra, "--task.config={bands: [[1.0, 12, 20]]}"]) == 0
    trajs = [e.trajectory for e in read_journal(run / "journal.jsonl") if isinstance(e, Finished)]
    assert trajs and all(len(t.prompt_ids) + t.length <= 72 for t in trajs)


def test_multi_turn_refuses_shaping_and_unknown_keys_naming_the_fix(tmp_path):
    argv = ["train", f"--run-dir={tmp_path / 'r'}", "--task.name=chaincalc"]
    assert main([*argv, "--shaping.name=darts"]) == 2
    assert main([*argv, "--task.max_turn=3"]) == 2  # an unknown key
