"""Every verb documents itself: usage, flags, and every config key it takes with type, default, meaning."""

import dataclasses
import typing

import pytest

from tailrace.cli import TAILRACE, main
from tailrace.config import RunConfig
from tailrace.config.fields import doc
from tailrace.flow.policies import POLICIES
from tailrace.trainer.losses import LOSSES


def fields_of(cls, prefix=""):
    """(dotted key, field, is a section) of every field of `cls`, sections and the keys in them."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        nested = dataclasses.is_dataclass(hints[f.name])
        yield prefix + f.name, f, nested
        if nested:
            yield from fields_of(hints[f.name], f"{prefix}{f.name}.")


def verbs(verb=TAILRACE):
    yield verb
    for v in verb.verbs:
        yield from verbs(v)


def help_of(capsys, *argv):
    rc = main([*argv])
    out = capsys.readouterr()
    assert rc == 0 and not out.err
    return out.out


@pytest.mark.parametrize("path", [v.name for v in verbs()], ids=lambda p: p or "tailrace")
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_verb_answers_help(capsys, path, flag):
    verb = next(v for v in verbs() if v.name == path)
    out = help_of(capsys, *path.split(), flag)
    assert out.startswith(f"usage: tailrace {verb.usage[0]}")
    assert all(f.name in out for f in verb.flags)
    assert all(v.name.split()[-1] in out for v in verb.verbs)


def test_top_level_help_lists_every_verb(capsys):
    out = help_of(capsys)  # no arguments at all
    verbs = ["train", "sft", "eval", "serve", "report", "model", "engine", "policy", "trace", "sim"]
    assert [v.name for v in TAILRACE.verbs] == verbs
    assert all(f"\n  {v.name} " in out for v in TAILRACE.verbs)


@pytest.mark.parametrize("path", ["train", "sft", "eval"])
def test_help_lists_exactly_the_keys_a_verb_reads(capsys, path):
    verb = TAILRACE.sub(path)
    out = help_of(capsys, path, "--help")
    for key, f, section in fields_of(RunConfig):
        listed = f"--{key} " in out
        assert listed == (not section and (verb.sections is None or key.split(".")[0] in verb.sections)), key
        if listed:
            # the meaning, however the lines wrap (a narrow terminal breaks "per-prompt" after its hyphen)
            assert "".join(doc(f).split()) in "".join(out.split()), key


def test_help_shows_type_default_and_registry_choices(capsys):
    out = help_of(capsys, "train", "--help")
    lines = " ".join(out.split())
    assert "--train.lr FLOAT|null AdamW learning rate" in lines and "(null = by the policy's size" in lines
    assert "--flow.frontier INT|null" in lines and "--model.dtype {auto,float32,bfloat16}" in lines
    assert f"--flow.mode {{{','.join(POLICIES)}}}" in lines
    assert f"--train.loss.name {{{','.join(LOSSES)}}}" in lines


def test_a_verb_rejects_keys_of_sections_it_does_not_read(capsys):
    rc = main(["sft", "--flow.steps=3"])
    out = capsys.readouterr()
    msg = (out.out + out.err).strip()
    assert rc == 2 and len(msg.splitlines()) == 1 and "flow.*" in msg and "arch, sft" in msg


def test_unknown_verb_gets_a_hint(capsys):
    rc = main(["trian"])
    out = capsys.readouterr()
    msg = (out.out + out.err).strip()
    assert rc == 2 and len(msg.splitlines()) == 1 and "did you mean train?" in msg


def test_sim_help_lists_the_scenario_keys(capsys):
    lines = " ".join(help_of(capsys, "sim", "--help").split())
    assert "--cluster.engines INT" in lines and "--flow.mode {" in lines and "[default: 20]" in lines


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train", "--resume"], "--resume needs a value; write --resume RUN_DIR"),
        (["sim", "calibrate", "--quick=yes"], "--quick is a switch"),
        (["--flow.mode=pipe"], "name a verb first"),
    ],
)
def test_flag_mistakes_are_one_line(capsys, argv, needle):
    rc = main(argv)
    out = capsys.readouterr()
    msg = (out.out + out.err).strip()
    assert rc == 2 and len(msg.splitlines()) == 1 and needle in msg
