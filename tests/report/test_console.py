"""The console's warnings: a base policy that never succeeds, and steps whose groups had no signal."""

import io

from rich.console import Console

from tailrace.records import EvalRecord, StepRecord
from tailrace.report.console import ConsoleUI

TIME = dict(gen_tok_s=1.0, step_s=1.0, trainer_wait_ratio=0.0, bubble_ratio=0.0)


def ui():
    out = io.StringIO()
    return ConsoleUI(Console(file=out, width=300), quiet=True), out


def step(i, complete, zero, dropped=0, skipped=0, accuracy=0.0):
    groups = {
        "complete": complete,
        "zero_signal": zero,
        "dropped": {"zero-signal": dropped} if dropped else {},
    }
    ledger = {"produced": 0, "trained": 0, "discarded": {}, "in_store": 0, "groups": groups}
    return StepRecord(i, i, 0.0, accuracy, 8, {}, {}, {}, ledger, {}, {"skipped": skipped}, TIME)


def test_a_base_policy_at_zero_percent_is_called_out():
    c, out = ui()
    c.begin(0, 4, EvalRecord("base", 0, dict(accuracy=0.0, n=64, p50=3, p99=9, max=12)))
    assert "0% at base on 64 prompts: RL has no signal; make the task easier (task.config)" in out.getvalue()
    c, out = ui()  # 0 of 8 says little: a base right 12% of the time scores 0 on 8 prompts 36% of the time
    c.begin(0, 4, EvalRecord("base", 0, dict(accuracy=0.0, n=8, p50=3, p99=9, max=12)))
    assert (
        "0% at base on 8 prompts: RL may have no signal (8 prompts rule out only an accuracy above 31%; "
        "raise eval.n to tell); if the steps find none either, make the task easier" in out.getvalue()
    )
    c, out = ui()
    c.begin(0, 4, EvalRecord("base", 0, dict(accuracy=0.25, n=64, p50=3, p99=9, max=12)))
    assert "warning" not in out.getvalue()


def test_steps_whose_groups_mostly_had_equal_rewards_warn_with_the_counts():
    c, out = ui()
    c.begin(0, 3, None)
    c.step(step(0, complete=16, zero=14, dropped=6), replacing=True)  # cumulative counts: 14 of 16
    c.step(step(1, complete=36, zero=28, dropped=6), replacing=True)  # 14 of 20: under 3/4, no warning
    # 4 of 4, none replaced (the step's allowance spent, or the run's last groups): replacing is on, so
    # the warning does not ask for it
    c.step(step(2, complete=40, zero=32, dropped=6, skipped=1), replacing=True)
    lines = [l for l in out.getvalue().splitlines() if "warning" in l]
    assert len(lines) == 2
    assert "step 1: 14 of 16 groups had equal rewards (no signal); 6 replaced by fresh prompts" in lines[0]
    assert "step 3: 4 of 4 groups had equal rewards (no signal); the step trained nothing" in lines[1]
    assert lines[1].endswith("make it easier; tune it with task.config")
    assert "too hard for this model (0% of the step's samples correct): make it easier" in lines[0]


def test_the_zero_signal_warning_asks_for_replacement_only_where_it_is_off_and_names_the_policy():
    c, out = ui()
    c.begin(0, 3, None)
    c.step(step(0, complete=16, zero=16), policy="solver")  # flow.zero_signal=train
    c.step(step(0, complete=16, zero=16, dropped=8), policy="verifier", replacing=True)
    lines = [l for l in out.getvalue().splitlines() if "warning" in l]
    assert lines[0].startswith("warning: solver: step 1: 16 of 16 groups had equal rewards")
    assert lines[0].endswith("tune it with task.config or set flow.zero_signal=replace")
    assert lines[1].startswith("warning: verifier: step 1: 16 of 16 groups had equal rewards (no signal); 8")
    assert lines[1].endswith("tune it with task.config")


def test_groups_a_filter_dropped_are_not_called_zero_signal_replacements():
    c, out = ui()
    c.begin(0, 3, None)
    r = step(0, complete=16, zero=16)
    r.ledger["groups"]["dropped"] = {"filtered": 5}
    c.step(r)
    line = next(l for l in out.getvalue().splitlines() if "warning" in l)
    assert "replaced" not in line and line.endswith("or set flow.zero_signal=replace")


def test_the_zero_signal_warning_says_too_hard_too_easy_or_all_or_nothing():
    for accuracy, says in ((0.99, "too easy for this model (99%"), (0.5, "all right or all wrong (50%")):
        c, out = ui()
        c.begin(0, 3, None)
        c.step(step(0, complete=16, zero=16, accuracy=accuracy))
        assert says in out.getvalue()


def test_after_a_resume_the_first_step_only_sets_the_baseline():
    c, out = ui()
    c.begin(5, 8, None)
    c.step(step(5, complete=100, zero=90))
    assert "warning" not in out.getvalue()
    c.step(step(6, complete=104, zero=94))
    assert "step 7: 4 of 4" in out.getvalue()


def test_a_shaped_step_shows_the_lengths_generated_beside_the_trained():
    c, out = ui()
    c.begin(0, 2, None)
    r = step(0, complete=4, zero=0)
    r.ledger.update(
        discarded={"shaping": 6}, generated={"n": 14, "tokens": 700, "p50": 40, "p99": 290, "max": 300}
    )
    c.step(StepRecord(0, 0, 0.0, 0.0, 8, {"p50": 30, "max": 120}, {}, {"shaping": 6}, r.ledger, {}, {}, TIME))
    c.step(step(1, complete=8, zero=0))  # no shaping: the line stays as it was
    lines = out.getvalue().splitlines()
    assert "len p50 30 max 120" in lines[0] and lines[0].endswith("generated p50 40 max 300")
    assert "generated" not in lines[1]


def test_a_step_line_shows_speculation_when_the_run_drafts():
    from dataclasses import replace

    from tailrace.metrics import speculation

    c, out = ui()
    c.begin(0, 2, None)
    c.step(step(0, complete=4, zero=0))
    spec = speculation(rows=100, verifies=40, drafted=200, accepted=150)
    c.step(replace(step(1, complete=8, zero=0), time={**TIME, **spec}))
    trained = speculation(rows=100, verifies=40, drafted=200, accepted=150, train=(20, 0.5))
    c.step(replace(step(2, complete=8, zero=0), time={**TIME, **trained}))
    lines = out.getvalue().splitlines()
    assert "spec" not in lines[0]
    assert "spec acc 0.75 len 3.8 on 0.40 fwd/tok 0.40" in lines[1] and "drafter" not in lines[1]
    assert lines[2].endswith("fwd/tok 0.40 drafter train 20 steps 25 ms/step")


def test_a_step_line_shows_each_reward_function_where_there_is_a_list():
    from dataclasses import replace

    c, out = ui()
    c.begin(0, 2, None)
    c.step(step(0, complete=4, zero=0))
    c.step(replace(step(1, complete=8, zero=0), rewards={"task": 0.25, "brief": 0.4375}))
    lines = out.getvalue().splitlines()
    assert "rewards" not in lines[0]
    assert "reward 0.000 (task 0.250 brief 0.438) acc" in lines[1]
