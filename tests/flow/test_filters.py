"""The store's entry filter (`store.filter`): a user's keep(prompt, samples) asked once per complete
group; a refused group leaves untrained (reason `filtered`) and a fresh prompt takes its place, within
the per-step allowance, in every mode; the ledger accounts each drop; a broken filter stops the run in
one line naming it."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.common import ConfigError, InputError
from tailrace.flow.filters import load_keep
from tailrace.flow.policies import make_policy
from tests.flow.test_zero_signal import MODES, informative, run, trained_groups


def refusing(*gids):
    asked = []

    def keep(prompt, samples):
        asked.append(samples[0].group)
        assert prompt.id == samples[0].prompt_id and len({t.group for t in samples}) == 1
        return samples[0].group not in gids

    keep.asked = asked
    return keep


def run_filtered(mode, keep, reward=informative, zero_signal="train", **kw):
    return run(mode, reward, zero_signal, keep=keep, **kw)


def test_sync_replaces_a_refused_group_in_its_slot_and_asks_each_group_once():
    keep = refusing(1)
    s, c = run_filtered("sync", keep, extra=1)
    assert trained_groups(c) == [[0, 4], [2, 3]]  # group 4, a fresh prompt, took group 1's slot
    assert sorted(keep.asked) == [0, 1, 2, 3, 4]  # once each, though the policy looks every poll
    assert s.ledger.state_dict() == {"produced": 10, "trained": 8, "discarded": {"filtered": 2}}
    assert s.ledger_record()["groups"]["dropped"] == {"filtered": 1}
    assert [m.data for m in c.marks if m.kind == "group_dropped"] == [{"group": 1, "reason": "filtered"}]


def test_zero_signal_is_judged_first_and_the_filter_is_not_asked_of_such_a_group():
    keep = refusing(2)
    s, c = run_filtered("sync", keep, reward=lambda g, i: 0.0 if g == 1 else informative(g, i),
                        zero_signal="replace", extra=2)  # fmt: skip
    assert s.ledger_record()["groups"]["dropped"] == {"zero-signal": 1, "filtered": 1}
    assert 1 not in keep.asked
    assert all(g not in (1, 2) for step in trained_groups(c) for g in step)


def test_past_the_allowance_refused_groups_are_trained_and_the_run_ends():
    """A filter that refuses everything: one swap a step, then the round trains what it has."""
    keep = refusing(*range(1000))
    s, c = run_filtered("sync", keep, extra=1)
    assert len(c.trained) == 2 and s.ledger_record()["groups"]["dropped"] == {"filtered": 2}
    assert s.ledger.trained == 8


def test_no_filter_and_zero_signal_train_drop_nothing():
    s, c = run("sync", lambda g, i: 0.0, "train", 5)
    assert trained_groups(c) == [[0, 1], [2, 3]] and s.ledger.total_discarded == 0


@settings(max_examples=30, deadline=None)
@given(mode=st.sampled_from(MODES), seed=st.integers(0, 10_000), K=st.integers(1, 3), slots=st.integers(2, 8))
def test_every_mode_trains_only_groups_the_filter_keeps(mode, seed, K, slots):
    G, U, steps = 2, 2, 6
    s, c = run_filtered(mode, lambda p, samples: samples[0].group % 3 != 1, extra=100, G=G, U=U,
                        steps=steps, seed=seed, K=K, slots=slots)  # fmt: skip
    assert len(c.trained) == steps and all(len(t.groups) == U for t in c.trained)
    assert all(g.id % 3 != 1 for t in c.trained for g in t.groups), "a refused group was trained"
    dropped = s.ledger_record()["groups"]["dropped"].get("filtered", 0)
    assert dropped > 0 and s.ledger.discarded == {"filtered": G * dropped}
    assert s.ledger.produced == s.ledger.trained + s.in_store() + s.ledger.total_discarded


@pytest.mark.parametrize(
    "keep, said",
    [
        (
            lambda p, samples: 1 / 0,
            r"store.filter=mine raised ZeroDivisionError: division by zero on group 0 ",
        ),
        (lambda p, samples: "yes", r"store.filter=mine returned 'yes' on group 0 \(prompt 0\), not True"),
    ],
)
def test_a_broken_filter_stops_the_run_in_one_line_naming_it(keep, said):
    with pytest.raises(InputError, match=said + ".*continue with --resume"):
        run("sync", informative, "train", 1, keep=keep, keep_name="mine")


def test_load_keep_finds_a_module_function_and_a_file_function(tmp_path, monkeypatch):
    (tmp_path / "myfilters.py").write_text("def short(prompt, samples):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_keep("myfilters:short").__name__ == "short"
    (tmp_path / "f.py").write_text("def long(prompt, samples):\n    return False\n")
    assert load_keep(f"{tmp_path / 'f.py'}:long")(None, []) is False


def test_load_keep_finds_a_module_in_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwdfilters.py").write_text("def keep(prompt, samples):\n    return True\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert load_keep("cwdfilters:keep").__name__ == "keep"


@pytest.mark.parametrize(
    "spec, said",
    [
        ("nocolon", "write it as module:function or path/to/file.py:function"),
        ("no_such_module_xyz:keep", "cannot import 'no_such_module_xyz'.*PYTHONPATH"),
        ("json:no_such_function", "json has no function 'no_such_function'"),
        ("/no/such/file.py:keep", "no file /no/such/file.py"),
    ],
)
def test_load_keep_says_what_is_wrong_and_the_fix(spec, said):
    with pytest.raises(ConfigError, match=said):
        load_keep(spec)


def test_a_filter_keeps_its_allowance_with_zero_signal_train():
    p = make_policy("sync", "train", None, keep=lambda p, s: True)
    assert p.extra_groups is None and p.entry.active
    assert make_policy("sync", "train", None).extra_groups == 0


def test_the_example_filters_keep_what_they_say():
    from pathlib import Path
    from types import SimpleNamespace as S

    here = Path(__file__).resolve().parents[2] / "examples" / "filters.py"
    informative, no_truncated = load_keep(f"{here}:informative"), load_keep(f"{here}:no_truncated")
    group = lambda right, cut=0: [S(correct=i < right, truncated=i < cut) for i in range(8)]  # noqa: E731
    assert [informative(None, group(k)) for k in range(9)] == [False] * 2 + [True] * 5 + [False] * 2
    assert no_truncated(None, group(3)) and not no_truncated(None, group(3, cut=1))


def test_a_poll_the_filter_broke_hands_back_what_it_had_booked():
    """The run directory keeps every trajectory finished before the error: the broken poll's journal
    entries come back from `salvage` (no commands), and with the earlier polls' they hold them all."""
    from tailrace.flow.scheduler import FlowSpec, Scheduler
    from tailrace.records import Finished
    from tests.flow.scripted import ScriptedCluster, prompts

    def keep(prompt, samples):
        if samples[0].group == 3:
            raise ValueError("no")
        return True

    s = Scheduler(make_policy("sync", "train", 1, keep=keep, keep_name="mine"), prompts(), [(4, 2)],
                  FlowSpec(4, 2, 2, 2))  # fmt: skip
    c = ScriptedCluster(s, lambda g, i: 3 + g, slots=4, train_ticks=3, reward=informative)
    with pytest.raises(InputError, match="store.filter=mine raised ValueError"):
        c.run(max_ticks=1_000)
    out = s.salvage()
    assert not out.commands
    salvaged = [e for e in out.journal if isinstance(e, Finished)]
    assert salvaged  # the last group's samples finished in the poll that broke
    finished = [e for e in c.journal if isinstance(e, Finished)] + salvaged
    assert len(finished) == s.ledger.produced == 8
