"""Several policies in one run (`policies`), end to end through real processes: one trainer process per
policy, the engines shared. Each policy keeps its own versions, staleness bound and ledger, and writes
a run directory of its own under policies/<name>/."""

import json
from pathlib import Path

import pytest

from tailrace.cli import main
from tailrace.common import ConfigError
from tailrace.config.load import load_config, policy_configs
from tailrace.records import Finished, read_journal
from tests.runtime.conftest import TINY_RUN


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in (json.loads(l) for l in lines if l.strip()) if r["kind"] == kind]


def available(out: str) -> list[float]:
    """The GiB each trainer sized its micro-batches from, as its start-up line says."""
    import re

    return [float(x) for x in re.findall(r"of ([0-9.]+) GiB available after the optimizer state", out)]


def test_two_policies_train_side_by_side_each_with_its_own_books(tiny_model, tmp_path, capfd):
    run = tmp_path / "run"
    policies = "[{name: sums, eval: {every: 2}}, {name: other, task: {seed: 7}, flow: {mode: multiversion, steps: 6}}]"
    argv = ["train", f"--model.path={tiny_model}", *TINY_RUN, "--flow.mode=sync", "--train.loss.kl_coef=0.01"]
    assert main([*argv, f"--run-dir={run}", f"--policies={policies}"]) == 0
    together = available(capfd.readouterr().out)
    for name, steps, bound in (("sums", 4, 0), ("other", 6, 1)):
        d = run / "policies" / name
        st = records(d, "step")
        assert [r["step"] for r in st] == list(range(steps))
        versions = [r["version"] for r in st]
        assert versions == sorted(versions) and versions[-1] >= 1  # its own counter, from 0
        assert max(int(k) for r in st for k in r["staleness"]) <= bound  # histogram: staleness -> samples
        led = st[-1]["ledger"]
        # 16 samples a step; every one trained once (the core checks the identity at every poll)
        assert led["trained"] == 16 * steps
        keys = [(e.trajectory.group, e.trajectory.sample_index) for e in read_journal(d / "journal.jsonl")
                if isinstance(e, Finished)]  # fmt: skip
        assert len(keys) == len(set(keys))
        evals = {r["tag"]: r for r in records(d, "eval")}
        assert evals["final"]["version"] == versions[-1]
        # sums also evaluates step 2's weights after training (its snapshot, in a spare engine version)
        assert set(evals) == ({"base", "final", "periodic"} if name == "sums" else {"base", "final"})
        if name == "sums":
            assert evals["periodic"]["step"] == 2 and evals["periodic"]["version"] == st[1]["version"]
        assert (d / "config.yaml").is_file()
        # each step record's time figures are over the window since the policy's own previous record:
        # its windows tile its timeline, and its trained tokens are its own trainer's
        t = [r["time"] for r in st]
        assert sum(x["step_s"] for x in t) == pytest.approx(t[-1]["wall_s"], rel=1e-6)
        assert sum(x["train_tok_s"] * x["step_s"] for x in t) == pytest.approx(
            sum(r["train"]["tokens"] for r in st), rel=1e-6
        )
        ckpt = sorted((d / "checkpoints").glob("step_*"))[-1]
        assert ckpt.name == f"step_{steps:06d}" and (ckpt / "model" / "model.safetensors").is_file()
    # a seeded sync policy is the same run beside another policy as alone: its requests' tokens do not
    # depend on what shares their batches, its trainer is its own
    alone = tmp_path / "alone"
    assert main([*argv, "--eval.every=2", f"--run-dir={alone}"]) == 0
    # the two trainers share the machine's memory: each sized its micro-batches from half of it
    (one,) = available(capfd.readouterr().out)
    assert len(together) == 2 and all(0.35 < x / one < 0.65 for x in together), (together, one)
    from tests.runtime.conftest import step_figures

    assert step_figures(records(alone, "step")) == [
        {k: v for k, v in r.items() if k != "time"} for r in records(run / "policies" / "sums", "step")
    ]
    # every policy finished: a resume is refused before anything changes the run
    kept = sorted(p.name for p in (run / "policies" / "other" / "checkpoints").iterdir())
    assert main(["train", "--resume", str(run)]) == 2
    assert main(["train", "--supervise", "--resume", str(run)]) == 2
    assert sorted(p.name for p in (run / "policies" / "other" / "checkpoints").iterdir()) == kept
    # `tailrace report RUN` compares the run's policies
    assert main(["report", str(run), "--out", str(tmp_path / "compare.html")]) == 0
    assert "sums" in (tmp_path / "compare.html").read_text()
    # each trainer's spans are its own lane
    events = [json.loads(l) for l in (run / "events.jsonl").read_text().splitlines()]
    spans = sorted((e["t0"], e["t1"], e["lane"]) for e in events if e.get("phase") == "train")
    assert {lane for *_, lane in spans} == {"trainer-sums", "trainer-other"}
    # flow.share=turns: the trainers share the trainer's core one step at a time
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two trainers trained at once"


@pytest.mark.slow
def test_each_policy_trains_with_data_parallel_ranks_of_its_own(tiny_model, tmp_path):
    """train.world_size=2 for two policies: each trainer leads two gloo ranks of its own (a process group
    and rendezvous per trainer: two sharing one would not form), the trainers taking turns on the shared
    cores as single processes do. Both policies end exact. (That a step of two ranks equals the one
    process's is test_train_e2e's.) The tiny model earns no reward, so a KL penalty makes every step
    compute."""
    from tests.runtime.conftest import assert_exact

    run = tmp_path / "run"
    argv = [
        "train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.steps=2",
        "--eval.n=4", "--flow.mode=sync", "--flow.zero_signal=train", "--train.world_size=2",
        "--train.micro_batch_tokens=256", "--train.loss.kl_coef=0.1",
        "--policies=[{name: a}, {name: b, task: {seed: 3}, flow: {mode: multiversion}}]",
    ]  # fmt: skip
    assert main(argv) == 0
    for name in ("a", "b"):
        assert_exact(run / "policies" / name, steps=2)
        assert records(run / "policies" / name, "step")[0]["train"]["tokens"] > 0
    events = [json.loads(l) for l in (run / "events.jsonl").read_text().splitlines()]
    spans = sorted((e["t0"], e["t1"]) for e in events if e.get("phase") == "train")
    assert len(spans) == 4 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # in turns


def test_a_policy_entry_that_cannot_run_is_refused_in_one_line(tmp_path):
    def load(policies: str, *more: str):
        from tailrace.cli.choices import check

        check(load_config(None, [f"--policies={policies}", *more]))

    with pytest.raises(ConfigError, match=r"policies\[0\]: each policy is a mapping with a name"):
        load("[{task: {seed: 1}}]")
    with pytest.raises(ConfigError, match=r"unique name"):
        load("[{name: a}, {name: a}]")
    with pytest.raises(ConfigError, match=r"policies\[1\]\.rollout: a policy sets only task, flow"):
        load("[{name: a}, {name: b, rollout: {slots: 4}}]")
    with pytest.raises(ConfigError, match=r"policies\[0\]\.flow\.time_limit_s: the run's"):
        load("[{name: a, flow: {time_limit_s: 5}}]")
    with pytest.raises(ConfigError, match=r"policies\[0\] \(a\): unknown config key task\.sed"):
        load("[{name: a, task: {sed: 1}}]")
    with pytest.raises(ConfigError, match=r"policies \(b\): flow\.mode='nope': choose one of"):
        load("[{name: a}, {name: b, flow: {mode: nope}}]")
    with pytest.raises(ConfigError, match=r"policies\[1\]\.task\.tool_threads: the run's"):
        load("[{name: a}, {name: b, task: {name: chaincalc, tool_threads: 2}}]")  # the driver's one pool
    with pytest.raises(ConfigError, match=r"policies \(b\): task\.name=chaincalc is multi-turn .* shaping"):
        load("[{name: a}, {name: b, task: {name: chaincalc}, shaping: {name: darts}}]")
    load("[{name: a}, {name: b, task: {name: chaincalc}}]")  # a multi-turn policy beside a single-turn one
    # each policy's trainer a Ray actor of its own, with data-parallel ranks of its own: taken
    load("[{name: a}, {name: b, train: {world_size: 2}}]", "--runtime.kind=ray", "--train.world_size=2")
    from tailrace.cli.choices import check_policies

    # engines that hold one version at a time serve one policy each: at least an engine a policy
    vllm = load_config(None, ["--policies=[{name: a}, {name: b}]"])
    object.__setattr__(vllm.rollout, "backend", "vllm")  # (a config naming it loads only where vLLM is)
    with pytest.raises(ConfigError, match=r"\(rollout\.backend=vllm\) need .* raise rollout\.engines to 2"):
        check_policies(vllm)
    with pytest.raises(ConfigError, match=r"\(rollout\.max_versions=1\) need .* rollout\.engines=1"):
        load("[{name: a}, {name: b}]", "--rollout.max_versions=1")
    load("[{name: a}, {name: b}]", "--rollout.max_versions=1", "--rollout.engines=2")
    load("[{name: a}, {name: b, flow: {mode: external}}]")  # an agent trains b through the run's endpoint
    with pytest.raises(ConfigError, match=r"policies \(b\): shaping\.name=darts .* the agent makes them"):
        load("[{name: a}, {name: b, flow: {mode: external}, shaping: {name: darts}}]")
    named = policy_configs(load_config(None, ["--policies=[{name: a, train: {lr: 0.001}}, {name: b}]"]))
    assert [(n, c.train.lr, c.policies) for n, c in named] == [("a", 0.001, []), ("b", None, [])]


def test_a_multi_turn_policy_trains_beside_a_single_turn_one(tool_model, tmp_path):
    """A chaincalc policy (tool calls, multiversion) beside a chainsum one (sync, listed first) on the
    shared engines: each sample's calls are answered by its own policy's environment, its parked
    samples continue under its own policy's versions (a token of another's fails the run), and both
    policies finish every step once, exact."""
    from tailrace.tokenizer import char_tokenizer
    from tests.runtime.conftest import assert_exact

    run = tmp_path / "run"
    calc = "{name: calc, task: {name: chaincalc}, flow: {mode: multiversion}, eval: {max_new_tokens: 96}}"
    base = [a for a in TINY_RUN if not a.startswith(("--flow.steps", "--rollout.max_new_tokens", "--eval.n"))]
    argv = ["train", f"--run-dir={run}", f"--model.path={tool_model}", *base, "--flow.steps=3", "--eval.n=8"]
    argv += ["--rollout.max_new_tokens=96", "--flow.mode=sync", f"--policies=[{{name: sums}}, {calc}]"]
    assert main(argv) == 0
    tok = char_tokenizer()
    for name in ("sums", "calc"):
        d = run / "policies" / name
        assert_exact(d, steps=3)
        assert sorted(r["tag"] for r in records(d, "eval")) == ["base", "final"]
        steps = records(d, "step")
        trajs = [e.trajectory for e in read_journal(d / "journal.jsonl") if isinstance(e, Finished)]
        called = [t for t in trajs if t.observed]
        evals = records(d, "eval")
        if name == "sums":  # single-turn: no call answered, no tool figures
            assert not called and all("tools" not in r for r in steps)
            assert all("tool_calls" not in r for r in evals)
            continue
        assert sum(r["tools"]["calls"] for r in steps) > 0, "the tool model should call the calculator"
        # its held-out episodes call the calculator too (answered by the driver between their turns)
        assert sum(r["tool_calls"] for r in evals) > 0, evals
        assert called
        for t in called:  # each observation follows its call, masked: logprob 0, never trained on
            ids = t.result.token_ids
            for a, b in t.observed:
                assert tok.decode(ids[:a]).endswith("]") and tok.decode(ids[a:b]).startswith("=")
                assert all(lp == 0.0 for lp in t.result.logprobs[a:b])
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert any(e.get("lane") == "tools" for e in events)  # the driver's one pool ran them


def test_a_lost_engine_and_a_lost_trainer_leave_every_policy_exact(tiny_model, tmp_path):
    """The shared engine killed (its replacement loads every policy's versions it held) and one
    policy's trainer killed (its replacement replays that policy's steps since its checkpoint): both
    policies finish every step once, their ledgers exact."""
    import os
    import signal

    from tests.runtime.conftest import assert_exact, recoveries, start_cli, wait_for_steps, workers_of
    from tests.runtime.test_faults import finish

    run = tmp_path / "run"
    p = start_cli(
        "train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.steps=6", "--eval.n=8",
        "--flow.mode=sync", "--flow.checkpoint_every=3", "--train.loss.kl_coef=0.01",
        "--policies=[{name: a}, {name: b, task: {seed: 3}, flow: {mode: multiversion}}]",
    )  # fmt: skip
    wait_for_steps(run / "policies" / "a", p, 2)
    names = {(Path("/proc") / str(w) / "comm").read_text().strip(): w for w in workers_of(p.pid)}
    os.kill(names["tr-engine0"], signal.SIGKILL)
    wait_for_steps(run / "policies" / "b", p, 5)
    os.kill(names["tr-trainer-b"], signal.SIGKILL)
    rc, out = finish(p, timeout=180)
    assert rc == 0, out
    # each recovery is recorded once its replacement is up: b, the faster policy, may lose its trainer
    # before the engine's replacement is, so the order is either
    got = [(m.data["worker"], m.data["cause"]) for m in recoveries(run)]
    assert sorted(got) == [("engine0", "died"), ("trainer-b", "died")], got
    for name in ("a", "b"):
        assert_exact(run / "policies" / name, steps=6)


POLICIES = "[{name: a}, {name: b, task: {seed: 3}, flow: {mode: multiversion, steps: 6}}]"
RESUMABLE = [
    *TINY_RUN,
    "--flow.mode=sync",
    "--flow.checkpoint_every=2",
    "--flow.keep_checkpoints=3",
    "--train.loss.kl_coef=0.01",
]


@pytest.fixture(scope="module")
def two_policies(tiny_model, tmp_path_factory) -> Path:
    """A whole run of two policies: a (sync, 4 steps) and b (multiversion, 6 steps), a checkpoint every 2
    steps. Copy it before changing anything in it."""
    run = tmp_path_factory.mktemp("two") / "run"
    argv = ["train", f"--run-dir={run}", f"--model.path={tiny_model}", *RESUMABLE, f"--policies={POLICIES}"]
    assert main(argv) == 0
    return run


def unfinish_policy(pol: Path, keep: int) -> None:
    """Make a finished policy look killed with `keep` checkpoints left (0: none, so it starts over): its
    final evaluation and newer checkpoints gone; its journal and metrics keep what the lost steps wrote."""
    import shutil

    metrics = pol / "metrics.jsonl"
    metrics.write_text("".join(l for l in metrics.read_text().splitlines(True) if '"tag":"final"' not in l))
    for ckpt in sorted((pol / "checkpoints").glob("step_*"))[keep:]:
        shutil.rmtree(ckpt)


@pytest.mark.parametrize("a_left", ["none", "finished"])
def test_a_run_of_several_policies_resumes_policy_by_policy(two_policies, tmp_path, capsys, a_left):
    """Each policy resumes from its own newest checkpoint: b from step 2 of 6 (journal tail replayed),
    while a, killed before its first checkpoint, starts over (its seeded sync steps come out identical
    to the run that never stopped), or, finished already, waits for b untouched."""
    import shutil

    from tests.runtime.conftest import assert_exact

    run = shutil.copytree(two_policies, tmp_path / "run")
    before = {n: (run / "policies" / n / "metrics.jsonl").read_text() for n in ("a", "b")}
    (run / "run.lock").unlink(missing_ok=True)
    unfinish_policy(run / "policies" / "b", keep=1)
    if a_left == "none":
        unfinish_policy(run / "policies" / "a", keep=0)
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert "b: resuming from checkpoint step_000002 (step 2)" in out
    if a_left == "none":
        assert "a: no checkpoint yet, so it starts over" in out
    else:
        assert "a: finished at step 4: it waits for the others" in out
        assert (run / "policies" / "a" / "metrics.jsonl").read_text() == before["a"]
    for name, steps in (("a", 4), ("b", 6)):
        d = run / "policies" / name
        assert_exact(d, steps)
        evals = [r["tag"] for r in records(d, "eval")]
        assert sorted(evals) == ["base", "final"], evals
    from tests.runtime.conftest import step_figures

    a_then = [json.loads(l) for l in before["a"].splitlines() if '"kind":"step"' in l]
    assert step_figures(records(run / "policies" / "a", "step")) == [
        {k: v for k, v in r.items() if k != "time"} for r in a_then
    ]


def test_a_resume_of_several_policies_refuses_an_edited_policy_and_a_finished_run(
    two_policies, tmp_path, capsys
):
    import shutil

    from tailrace.cli.commands import _plan_policies
    from tailrace.runtime.rundir import RunDir

    run = shutil.copytree(two_policies, tmp_path / "run")
    (run / "run.lock").unlink(missing_ok=True)
    kept = sorted(p.name for p in (run / "policies" / "b" / "checkpoints").iterdir())
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2  # every policy finished
    last = sorted((run / "policies" / "a" / "checkpoints").glob("step_*"))[-1] / "model"
    assert f"--model.path={last} starts one from policy a's last weights" in capsys.readouterr().out
    assert main(["train", "--resume", str(run), "--flow.steps=9"]) == 2  # not trained on: steps per policy
    assert "each policy has its own flow.steps" in capsys.readouterr().out
    unfinish_policy(run / "policies" / "b", keep=1)
    cfg = (run / "config.yaml").read_text()
    assert "steps: 6" in cfg
    (run / "config.yaml").write_text(cfg.replace("steps: 6", "steps: 7"))
    with pytest.raises(ConfigError, match=r"changed policy b's flow\.steps since the run wrote"):
        _plan_policies(RunDir(run))
    assert main(["train", "--resume", str(run)]) == 2
    assert sorted(p.name for p in (run / "policies" / "b" / "checkpoints").iterdir()) == kept[:1]


def test_a_supervised_run_of_several_policies_survives_its_driver_killed(tiny_model, tmp_path):
    """`--supervise`: the driver killed with -9 mid-run is resumed, each policy from its own checkpoint
    (or from the start), and every policy ends exact."""
    from tests.runtime.conftest import assert_exact, recoveries, start_cli
    from tests.runtime.test_supervise import assert_resumed_once, kill_the_driver

    run = tmp_path / "run"
    policies = "[{name: a}, {name: b, task: {seed: 3}, flow: {mode: multiversion, steps: 6}}]"
    p = start_cli(
        "train", "--supervise", f"--run-dir={run}", f"--model.path={tiny_model}", *RESUMABLE, "--flow.steps=4",
        f"--policies={policies}",
    )  # fmt: skip
    rc, out = kill_the_driver(p, run / "policies" / "b", 3, timeout=240)
    assert rc == 0, out
    assert_resumed_once(out, run)
    (m,) = recoveries(run)
    assert (m.data["worker"], m.data["cause"]) == ("driver", "died")
    for name, steps in (("a", 4), ("b", 6)):
        assert_exact(run / "policies" / name, steps)
        assert [r["tag"] for r in records(run / "policies" / name, "eval")].count("final") == 1


def test_drafters_serve_several_policies_and_change_no_recorded_figure_but_time(tiny_model, tmp_path):
    """Two seeded sync policies, without and with the history drafter (toggle off: every decode row
    drafts; bubble pre-generation on): speculation is exact, so each policy's step records are the
    same but for `time`, whose acceptance by version is the policy's own versions."""
    runs = {}
    for arm, spec in (("off", []), ("spec", ["--rollout.spec.drafter=history", "--rollout.spec.toggle=false",
                                             "--rollout.spec.pregen_below=1.0"])):  # fmt: skip
        run = tmp_path / arm
        argv = ["train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.mode=sync"]
        policies = "[{name: a}, {name: b, task: {seed: 5}}]"
        assert (
            main([*argv, "--flow.steps=3", "--flow.zero_signal=train", f"--policies={policies}", *spec]) == 0
        )
        runs[arm] = {n: records(run / "policies" / n, "step") for n in ("a", "b")}
    accepted = 0  # a policy's drafts accepted: 0-5 in 3 steps, by which siblings finish first
    for name in ("a", "b"):
        off, on = runs["off"][name], runs["spec"][name]
        assert [{k: v for k, v in r.items() if k != "time"} for r in off] == [
            {k: v for k, v in r.items() if k != "time"} for r in on
        ]
        t = [r["time"] for r in on]
        assert sum(x["spec_drafted"] for x in t) > 0
        accepted += sum(x["spec_accepted"] for x in t)
        for r, x in zip(on, t):  # sync: a step's samples are of the policy's version before it
            assert set(x["spec_by_version"]) <= {str(r["version"] - 1)}
    assert accepted > 0
    events = [
        json.loads(l)
        for l in (tmp_path / "spec" / "policies" / "a" / "events.jsonl").read_text().splitlines()
    ]
    assert any(e.get("kind") == "pregen" for e in events)  # the next round's prompts, drafted in a bubble


def test_two_policies_share_engines_that_hold_one_version_each_serving_one_policy(tiny_model, tmp_path):
    """rollout.max_versions=1 (as vLLM): each engine holds one weight version, so each serves one
    policy — engine 0 the first, engine 1 the second — and loads that policy's versions only while
    training. The held-out evaluations load each policy's weights on every engine in turn (base,
    final, and a snapshot's); every policy ends exact, each evaluation under its own version."""
    from tailrace.records import Mark, read_events
    from tests.runtime.conftest import assert_exact

    run = tmp_path / "run"
    argv = [
        "train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.mode=sync",
        "--rollout.max_versions=1", "--rollout.engines=2", "--eval.n=8",
        "--policies=[{name: a, eval: {every: 2}}, {name: b, task: {seed: 3}, flow: {mode: pipe}}]",
    ]  # fmt: skip
    assert main(argv) == 0
    for engine, name in enumerate(("a", "b")):
        d = run / "policies" / name
        assert_exact(d, steps=4)
        loads = [m for m in read_events(d / "events.jsonl") if isinstance(m, Mark) and m.kind == "loaded"]
        # the versions it trained to, on its own engine only (version 0: also on the other for the base
        # evaluation, and again on its own, which the other policy's base evaluation had replaced)
        assert {m.data["engine"] for m in loads if m.data["version"]} == {engine}
        base_loads = {(m.data["engine"], m.data["version"]) for m in loads if not m.data["version"]}
        assert base_loads == {(0, 0), (1, 0)}
        versions = [r["version"] for r in records(d, "step")]
        evals = {r["tag"]: r for r in records(d, "eval")}
        assert evals["base"]["version"] == 0 and evals["final"]["version"] == versions[-1]
        assert all(e["n"] == 8 for e in evals.values())
    assert records(run / "policies" / "a", "eval")[-1]["tag"] == "periodic"
