"""Damaged input to the real entry points (`tailrace.cli.main`, in this process): config overrides, YAML
files, JSONL datasets, checkpoint directories, run directories. Every case ends in exit code 2 with one
clear line, or a correct run — never a traceback, a hang, or lost data. (Exit code 3 with one line is
also right where the input is valid but trains to nan: the run stops before publishing it.)"""

import dataclasses
import json
import random
import shutil
import tempfile
import typing
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tailrace.cli import main
from tailrace.config import RunConfig
from tailrace.records import Finished, RecordFormatError, StepRecord, read_journal, read_metrics
from tests.runtime.conftest import checkpoints, copy_run, unfinish

pytestmark = pytest.mark.slow
# no shrinking: each example runs the real command (seconds), and the damage is already small and named
FUZZ = settings(
    max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)  # fmt: skip
QUICK = [  # overrides that keep a valid run to a few seconds
    "--flow.steps=1", "--flow.prompts_per_round=2", "--flow.samples_per_prompt=2", "--flow.train_batch=4",
    "--rollout.max_new_tokens=8", "--rollout.slots=4", "--eval.n=4", "--eval.max_new_tokens=8",
]  # fmt: skip


def keys(cls=RunConfig, prefix=""):
    for name, tp in typing.get_type_hints(cls).items():
        yield from keys(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [prefix + name]


KEYS = [k for k in keys() if k not in ("model.path", "out")] + ["flow.stepz", "train.loss", "nope"]
VALUES = ["-5", "-1", "0", "1", "2", "3", "0.5", "1e30", "1e-45", "inf", "nan", "-inf", "null", "", "x",
          "[1, 2]", "{a: 1}", "true", "[/x]", "[bold]", "sync", "pipe", "grpo", "drgrpo"]  # fmt: skip


def outcome(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    assert "Traceback" not in text
    if rc in (2, 3):
        errors = [l for l in text.splitlines() if l.startswith("error:")]
        assert len(errors) == 1 and text.splitlines()[-1] == errors[0], text
        if rc == 3:
            assert "finite" in errors[0], text  # valid input that trains to nan; nothing else may fault
    else:
        assert rc == 0, text
    return rc, text


def assert_finished(run: Path, steps: int) -> None:
    recs = list(read_metrics(run / "metrics.jsonl"))
    assert [r.step for r in recs if isinstance(r, StepRecord)] == list(range(steps))
    assert [r.tag for r in recs if getattr(r, "tag", None)] == ["base", "final"]


def effective_steps(overrides: list[str]) -> int:
    from tailrace.config import load_config

    return load_config(None, QUICK + overrides).flow.steps


@FUZZ
@given(pairs=st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)), min_size=1, max_size=3))
def test_fuzzed_overrides(capsys, tiny_model, tmp_path_factory, pairs):
    overrides = [f"--{k}={v}" for k, v in pairs]
    run = tmp_path_factory.mktemp("fuzz") / "run"
    rc, _ = outcome(capsys, ["train", f"--run-dir={run}", f"--model.path={tiny_model}", *QUICK, *overrides])
    if rc == 0:
        limit = yaml.safe_load((run / "config.yaml").read_text())["flow"]["time_limit_s"]
        if limit is None:
            assert_finished(run, effective_steps(overrides))
    elif rc == 2:
        assert not (run / "metrics.jsonl").exists()


def yaml_texts():
    value = st.sampled_from(VALUES).map(lambda v: yaml.safe_load(v) if v not in ("", "[/x]", "[bold]") else v)
    tree = st.dictionaries(
        st.sampled_from(["flow", "rollout", "train", "eval", "task", "seed", "model", "bogus"]),
        st.one_of(
            value, st.dictionaries(st.sampled_from([k.split(".")[-1] for k in KEYS]), value, max_size=3)
        ),
        max_size=3,
    )
    raw = st.sampled_from([
        "flow: [", "flow:\n  steps: 1\n bad indent", "!!python/object/apply:os.system ['touch PWNED']",
        "- a\n- b", "42", "", "\x00\x01", "\udcff", "flow: {steps: !!float nan}", "train:\n  lr: .inf",
    ])  # fmt: skip
    return st.one_of(tree.map(lambda d: yaml.safe_dump(d)), raw, st.text(max_size=40))


@FUZZ
@given(text=yaml_texts())
def test_fuzzed_yaml_config(capsys, tiny_model, tmp_path_factory, text):
    d = tmp_path_factory.mktemp("fuzz")
    f = d / "run.yaml"
    f.write_bytes(text.encode("utf-8", "surrogateescape"))  # "\udcff": a byte that is not UTF-8
    run = d / "run"
    rc, _ = outcome(
        capsys, ["train", f"--config={f}", f"--run-dir={run}", f"--model.path={tiny_model}", *QUICK]
    )
    assert not Path("PWNED").exists()
    if rc == 0:
        assert_finished(run, 1)


def jsonl_lines():
    good = st.builds(
        lambda q, a: json.dumps({"question": q, "answer": a}), st.text(max_size=30), st.text(max_size=5)
    )
    bad = st.sampled_from([
        "{oops", "[1, 2]", "null", "42", '"text"', json.dumps({"question": "q"}), json.dumps({"answer": "1"}),
        json.dumps({"question": 5, "answer": 6}), json.dumps({"question": None, "answer": "1"}), "",
        json.dumps({"question": "x" * 5000, "answer": "1"}), "\ufeff" + json.dumps({"question": "q", "answer": "a"}),
    ])  # fmt: skip
    return st.lists(st.one_of(good, good, bad), max_size=8)


@settings(FUZZ, max_examples=25)
@given(lines=jsonl_lines())
def test_fuzzed_jsonl_dataset(capsys, tiny_model, tmp_path_factory, lines):
    data = tmp_path_factory.mktemp("fuzz") / "data.jsonl"
    data.write_text("\n".join(lines))
    argv = [
        "eval",
        f"--model.path={tiny_model}",
        f"--task.name=jsonl:{data}",
        "--eval.n=2",
        "--eval.max_new_tokens=4",
    ]
    outcome(capsys, argv)


DAMAGE = ["truncate", "flip", "delete", "garble-json", "config-value"]


def damage_model(model: Path, how: str, rng: random.Random) -> None:
    files = sorted(f for f in model.iterdir() if f.is_file())
    f = rng.choice(files)
    data = f.read_bytes()
    if how == "truncate":
        f.write_bytes(data[: rng.randrange(len(data) + 1)])
    elif how == "flip":
        i = rng.randrange(len(data))
        f.write_bytes(data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1 :])
    elif how == "delete":
        f.unlink()
    elif how == "garble-json":
        (model / "config.json").write_text(rng.choice(["{", "[]", "null", '{"model_type": "llama"}']))
    else:
        cfg = json.loads((model / "config.json").read_text())
        key = rng.choice(sorted(cfg))
        cfg[key] = rng.choice([0, -1, 1, 3, 10**9, None, "x", 1e30, True, []])
        (model / "config.json").write_text(json.dumps(cfg))


@settings(FUZZ, max_examples=25)
@given(how=st.sampled_from(DAMAGE), seed=st.integers(0, 10**6))
def test_fuzzed_checkpoint_directory(capsys, tiny_model, tmp_path_factory, how, seed):
    model = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(tiny_model, model)
    damage_model(model, how, random.Random(seed))
    outcome(capsys, ["eval", f"--model.path={model}", "--eval.n=2", "--eval.max_new_tokens=4"])


RUN_DAMAGE = ["torn", "garbage-line", "flip-line", "drop-line", "ckpt-truncate", "ckpt-delete", "ckpt-json",
              "leftover", "config-garble"]  # fmt: skip


def damage_run(run: Path, how: str, rng: random.Random) -> None:
    jsonl = run / rng.choice(["journal.jsonl", "metrics.jsonl", "events.jsonl"])
    lines = jsonl.read_bytes().splitlines(keepends=True)
    i = rng.randrange(len(lines))
    newest = checkpoints(run)[-1]
    if how == "torn":
        jsonl.write_bytes(b"".join(lines) + lines[i][: rng.randrange(1, len(lines[i]) - 1)])
    elif how == "garbage-line":
        lines.insert(i, rng.choice([b"{\n", b"\x00\x00\x00\n", b"[]\n", b"garbage\n"]))
        jsonl.write_bytes(b"".join(lines))
    elif how == "flip-line":
        j = rng.randrange(len(lines[i]) - 1)
        lines[i] = lines[i][:j] + bytes([lines[i][j] ^ 0x20]) + lines[i][j + 1 :]
        jsonl.write_bytes(b"".join(lines))
    elif how == "drop-line":
        del lines[i]
        jsonl.write_bytes(b"".join(lines))
    elif how in ("ckpt-truncate", "ckpt-delete"):
        f = rng.choice(sorted(p for p in newest.rglob("*") if p.is_file()))
        f.unlink() if how == "ckpt-delete" else f.write_bytes(
            f.read_bytes()[: rng.randrange(f.stat().st_size)]
        )
    elif how == "ckpt-json":
        (newest / "scheduler.json").write_text(rng.choice(["{", "{}", "[]", '{"journal_seq": "x"}']))
    elif how == "leftover":
        (run / "checkpoints" / "step_000099.tmp").mkdir()
        (run / "metrics.jsonl.tmp").write_text("half")
    else:
        (run / "config.yaml").write_text(rng.choice(["flow: [", "flow: {steps: -1}", "{}", "bogus: 1"]))


def readable(run: Path) -> tuple[set[int], set[str]]:
    """The step records and finished trajectories (request ids) a reader finds in `run`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            steps = {r.step for r in read_metrics(run / "metrics.jsonl") if isinstance(r, StepRecord)}
        except RecordFormatError:  # a flipped byte made a record another format's: refused, said once
            steps = set()
        try:
            done = {
                e.trajectory.result.request_id
                for e in read_journal(run / "journal.jsonl")
                if isinstance(e, Finished)
            }
        except RecordFormatError:
            done = set()
    return steps, done


@settings(FUZZ, max_examples=8)
@given(how=st.sampled_from(RUN_DAMAGE), seed=st.integers(0, 10**6))
def test_fuzzed_run_directory(capsys, finished_run, how, seed):
    with tempfile.TemporaryDirectory() as d:
        run = unfinish(copy_run(finished_run, Path(d) / "run"))
        damage_run(run, how, random.Random(seed))
        steps, done = readable(run)
        rc, out = outcome(capsys, ["train", f"--resume={run}"])
        quarantine = run / "journal.jsonl.quarantine"
        moved = quarantine.read_text() if quarantine.exists() else ""
        steps_after, done_after = readable(run)
        assert all(r in done_after or r in moved for r in done), "a finished trajectory was lost"
        if rc == 0:  # every step once (those the damage left, and those redone), one final evaluation
            recs = list(read_metrics(run / "metrics.jsonl"))
            ran = [r.step for r in recs if isinstance(r, StepRecord)]
            assert len(ran) == len(set(ran)) and set(ran) >= steps | {3}
            assert [r.tag for r in recs if getattr(r, "tag", None) == "final"] == ["final"]
            last = [r for r in recs if isinstance(r, StepRecord)][-1].ledger
            assert last["produced"] == last["trained"] + last["in_store"] + sum(last["discarded"].values())
