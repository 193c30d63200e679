"""Scenarios from YAML, the run directory a simulation writes, and `tailrace sim` on the command line."""

import json

import pytest
import yaml

from tailrace.cli import main
from tailrace.common import ConfigError
from tailrace.config import FlowConfig, RunConfig, dump_config, load_config
from tailrace.records import Finished, Opened, StepRecord, dumps
from tailrace.sim import compare
from tailrace.sim.hardware import get_hardware
from tailrace.sim.scenario import (
    ClusterSpec,
    Scenario,
    apply_overrides,
    build,
    load_scenario,
    scenario_from_run,
    simulate,
)
from tailrace.types import Finish, GenResult, Prompt, Trajectory

SMALL = {
    "name": "small",
    "cluster": {"hardware": "h100", "model": "qwen3-1.7b", "engines": 2, "slots": 16, "trainer_gpus": 2},
    "flow": {"mode": "sync", "prompts_per_round": 4, "samples_per_prompt": 4, "train_batch": 8, "steps": 4},
    "lengths": {"kind": "lognormal", "median": 800, "max_len": 4096, "runaway": 0.05, "prompt": 128},
}


def test_a_simulated_run_writes_the_files_of_a_real_run(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    out = tmp_path / "run"
    assert main(["sim", "--config", str(path), "--out", str(out)]) == 0
    for f in ("config.yaml", "metrics.jsonl", "events.jsonl", "journal.jsonl", "report.html", "summary.json"):
        assert (out / f).is_file(), f
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert {"step_s", "trainer_wait_ratio", "bubble_ratio", "gen_tok_s", "weight_sync_s"} <= set(
        steps[0]["time"]
    )
    # lengths produced since the step before: a round's 16 samples, reported with its first step
    assert [s["ledger"].get("generated", {}).get("n") for s in steps] == [16, None, 16, None]
    assert steps[-1]["ledger"] == {
        "produced": 32,
        "trained": 32,
        "discarded": {},
        "in_store": 0,
        "groups": {"complete": 8, "zero_signal": 0, "dropped": {}},
        "shaping_tokens": 0,
    }
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    lanes = {e["lane"] for e in events}
    assert {"engine0", "engine1", "trainer", "scheduler"} <= lanes
    assert all(e["t1"] >= e["t0"] for e in events if "phase" in e)
    assert load_scenario(out / "config.yaml").cluster.engines == 2  # the written config runs again


def test_bad_scenarios_fail_with_one_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "cluster": {**SMALL["cluster"], "hardware": "tpu9"}}))
    assert main(["sim", "--config", str(path), "--out", str(tmp_path / "x")]) == 2
    assert main(["sim", "--config", str(path), "--cluster.engnes=3"]) == 2
    with pytest.raises(ConfigError, match="train_batch"):
        load_scenario(None, ["--flow.train_batch=12"])
    with pytest.raises(ConfigError, match="engines"):
        ClusterSpec(engines=0)
    with pytest.raises(ConfigError, match="flow.mode=external .* the simulator has no agent"):
        build(load_scenario(None, ["--flow.mode=external"]))
    with pytest.raises(ConfigError, match="store.filter=f.py:keep: the simulator does not run a filter"):
        build(load_scenario(None, ["--store.filter=f.py:keep"]))


def test_overrides_and_every_mode_on_a_gpu_scenario():
    base = load_scenario(
        None,
        [
            f"--{k}={v}"
            for k, v in (
                ("cluster.hardware", "h800"),
                ("cluster.model", "qwen2.5-7b"),
                ("flow.steps", 6),
                ("flow.prompts_per_round", 4),
                ("flow.samples_per_prompt", 4),
                ("flow.train_batch", 8),
            )
        ],
    )
    results = {}
    for mode in ("sync", "pipe", "async", "partial", "multiversion"):
        s = simulate(apply_overrides(base, [f"--flow.mode={mode}", "--journal=false"]))
        assert s["steps"] == 6 and s["ledger"]["trained"] == 6 * 8
        results[mode] = s
    assert set(results["sync"]["staleness"]) == {"0"} and set(results["pipe"]["staleness"]) == {"0"}
    assert results["pipe"]["trainer_wait_ratio"] < results["sync"]["trainer_wait_ratio"]


def _fake_run(tmp_path, dtype="float32", backend="tailrace", **train):
    """A run directory as tailrace train leaves it: config, journal of finished samples, step records."""
    tmp_path.mkdir()
    cfg = RunConfig(flow=FlowConfig(prompts_per_round=4, samples_per_prompt=4, train_batch=16, steps=3))
    cfg.model.dtype, cfg.rollout.backend = dtype, backend
    for k, v in train.items():
        setattr(cfg.train, k, v)
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    lines, steps = [], []
    for g in range(12):
        lines.append(dumps(Opened(g, 0, g + 1, False, Prompt(g, (1,) * 12, ""))))
        for i in range(4):
            n = 20 + (g * 37 + i * 11) % 200
            r = GenResult(f"{g}.{i}.0", (7,) * n, (-1.0,) * n, (0,) * n, Finish.STOP)
            lines.append(dumps(Finished(Trajectory(g, i, g, (1,) * 12, r, 1.0, True))))
    (tmp_path / "journal.jsonl").write_text("\n".join(lines) + "\n")
    time = {"step_s": 1.0, "train_s": 0.4, "step_trainer_wait_ratio": 0.5, "step_bubble_ratio": 0.8}
    for k in range(3):
        rec = StepRecord(
            k, 0, 0.5, 0.5, 16, {"bubble": 0.5}, {}, {}, {}, {}, {}, {**time, "gen_tok_s": 3000.0}
        )
        steps.append(dumps(rec))
    (tmp_path / "metrics.jsonl").write_text("\n".join(steps) + "\n")
    return tmp_path


def test_a_real_run_directory_becomes_a_scenario_and_compares(tmp_path):
    run = _fake_run(tmp_path / "real")
    scn = scenario_from_run(run)
    assert scn.cluster.hardware == "cpu" and scn.cluster.slots == 64 and scn.flow.steps == 3
    assert scn.lengths == {
        "kind": "empirical",
        "run_dir": str(run),
        "max_len": RunConfig().rollout.max_new_tokens,
    }
    out = tmp_path / "sim"
    assert main(["sim", "--like", str(run), "--out", str(out), "--flow.steps=2"]) == 0
    real, sim = compare.step_figures(run), compare.step_figures(out)
    assert sim["steps"] == 2 and real["step_s"] == 1.0
    rows = compare.compare(real, sim)
    assert [r[0] for r in rows] == list(compare.FIGURES)


def test_a_run_of_several_updates_a_step_is_charged_its_passes(tmp_path):
    one = scenario_from_run(_fake_run(tmp_path / "one")).cluster
    ppo = scenario_from_run(_fake_run(tmp_path / "ppo", mini_batches=2, epochs=3)).cluster
    assert (one.train_updates, one.train_epochs, one.recompute_logprobs, one.critic) == (1, 1, False, False)
    assert scenario_from_run(_fake_run(tmp_path / "gae", advantage="gae")).cluster.critic
    assert (ppo.train_updates, ppo.train_epochs, ppo.recompute_logprobs) == (6, 3, True)
    run = _fake_run(tmp_path / "top")
    cfg = load_config(run / "config.yaml", ["--train.loss.top_entropy=0.2"])
    (run / "config.yaml").write_text(dump_config(cfg))
    assert scenario_from_run(run).cluster.recompute_logprobs


def test_a_vllm_run_is_simulated_and_the_comparison_says_its_engine_was_another(tmp_path, capsys):
    """(Where vLLM is not installed too: the run directory loads anywhere.)"""
    run = _fake_run(tmp_path / "real", backend="vllm")
    assert main(["sim", "--like", str(run), "--out", str(tmp_path / "sim"), "--flow.steps=2"]) == 0
    assert "note: the run rolled out on vLLM" in capsys.readouterr().out


def test_a_bf16_run_is_simulated_on_the_bf16_cpu_preset(tmp_path):
    scn = scenario_from_run(_fake_run(tmp_path / "real", dtype="bfloat16"))
    assert scn.cluster.hardware == "cpu-bf16" and not scn.cluster.hardware_overrides
    hw = get_hardware("cpu-bf16")  # uncalibrated here: the fallback at half the bytes per value
    assert hw.name == "cpu-bf16" and hw.dtype_bytes == 2 and get_hardware("cpu").dtype_bytes == 4


def test_default_scenario_is_the_cpu_testbed():
    scn = Scenario()
    assert scn.cluster.hardware == "cpu" and scn.cluster.slots == 64 and scn.flow.samples_per_prompt == 8


def test_trainer_speed_is_recovered_from_a_run_directory(tmp_path):
    scn = load_scenario(
        None,
        [
            "--cluster.hardware=h100",
            "--cluster.model=qwen3-1.7b",
            "--cluster.trainer_gpus=2",
            "--flow.prompts_per_round=4",
            "--flow.samples_per_prompt=4",
            "--flow.train_batch=8",
            "--flow.steps=6",
            "--lengths={kind: lognormal, median: 500, max_len: 4000, prompt: 64}",
        ],
    )
    simulate(scn, tmp_path / "run")
    from tailrace.sim.scenario import cost_model

    cost = cost_model(scn)
    overhead, rate = compare.trainer_rate(tmp_path / "run", cost)
    assert overhead == pytest.approx(cost.hw.train_step_overhead_s, rel=1e-6)
    assert rate == pytest.approx(2 * cost.hw.peak_flops * cost.hw.train_mfu, rel=1e-6)
    assert compare.generate_busy_s(tmp_path / "run") > 0


def test_generate_busy_counts_only_the_training_window(tmp_path):
    events = [
        {"lane": "engine0", "phase": "generate", "t0": 0.0, "t1": 2.0},  # base evaluation
        {"lane": "scheduler", "kind": "group_first_dispatch", "t": 2.5, "group": 0},
        {"lane": "engine0", "phase": "generate", "t0": 2.5, "t1": 4.0},
        {"lane": "engine0", "phase": "generate", "t0": 4.5, "t1": 6.0},  # straddles the last step
        {"lane": "scheduler", "kind": "trained", "t": 5.0, "step": 0},
        {"lane": "engine0", "phase": "generate", "t0": 6.0, "t1": 9.0},
    ]  # final evaluation
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert compare.generate_busy_s(tmp_path) == pytest.approx(1.5 + 0.5)
