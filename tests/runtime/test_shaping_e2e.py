"""`tailrace train --shaping.name=darts` through real processes: extra candidates are generated, the
unselected ones (finished, or aborted by early stop) are discarded with the reason `shaping`, and
every step still trains whole groups."""

import json

from tailrace.cli import main
from tests.runtime.conftest import TINY_RUN


def test_darts_trains_whole_groups_and_accounts_every_extra_candidate(tiny_model, tmp_path):
    run = tmp_path / "run"
    shaping = [
        "--shaping.name=darts",
        "--shaping.extra=1.0",
        "--shaping.early_stop=0.5",
        "--task.train_size=8",
    ]
    argv = [
        "train",
        f"--run-dir={run}",
        f"--model.path={tiny_model}",
        *TINY_RUN,
        "--flow.steps=2",
        "--eval.n=4",
    ]
    assert main([*argv, *shaping]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert [s["samples"] for s in steps] == [16, 16]
    last = steps[-1]["ledger"]
    # 2 rounds x 4 prompts x 8 candidates, half of them trained; the rest discarded (or never started)
    assert last["trained"] == 32 and last["discarded"].get("shaping", 0) > 0
    assert last["produced"] == last["trained"] + sum(last["discarded"].values()) + last["in_store"]
    assert last["shaping_tokens"] > 0 and steps[0]["ledger"]["generated"]["n"] > 16


def test_tail_batching_defers_the_slowest_prompts_to_a_tail_round(tiny_model, tmp_path):
    """R = 4 prompts a round (one step each), eta 1.5: short rounds open 6 and keep the first 4 to
    complete; after two of them the 4 deferred prompts run as the third round, a tail round."""
    run = tmp_path / "run"
    argv = [
        "train",
        f"--run-dir={run}",
        f"--model.path={tiny_model}",
        *TINY_RUN,
        "--flow.steps=3",
        "--eval.n=4",
    ]
    assert main([*argv, "--shaping.name=tailbatch", "--shaping.eta=1.5"]) == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    rounds = [(e["tail"], len(e["groups"])) for e in events if e.get("kind") == "round_start"]
    assert rounds == [(False, 6), (False, 6), (True, 4)]
    deferred = [e["prompt"] for e in events if e.get("kind") == "group_deferred"]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert [s["samples"] for s in steps] == [16, 16, 16]
    last = steps[-1]["ledger"]
    assert last["trained"] == 48 and last["discarded"].get("shaping", 0) > 0
    assert last["produced"] == last["trained"] + sum(last["discarded"].values()) + last["in_store"]
    journal = [json.loads(line) for line in (run / "journal.jsonl").read_text().splitlines()]
    tail_prompts = [j["prompt"]["id"] for j in journal if j["kind"] == "open" and j.get("own")]
    assert sorted(tail_prompts) == sorted(deferred) and len(deferred) == 4


def test_april_carries_the_unfinished_groups_into_the_next_round(tiny_model, tmp_path):
    """R = 4 prompts a round, over 2: each round keeps 8 groups going, trains the first 4 to complete
    and carries the rest (their unfinished samples resumed under the new weights); nothing discarded.
    The last round opens nothing new and trains the 4 carried: nothing is left over."""
    run = tmp_path / "run"
    argv = [
        "train",
        f"--run-dir={run}",
        f"--model.path={tiny_model}",
        *TINY_RUN,
        "--flow.steps=3",
        "--eval.n=4",
    ]
    assert main([*argv, "--shaping.name=april", "--train.loss.correction=tis"]) == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    cuts = [e for e in events if e.get("kind") == "round_cut"]
    starts = [e for e in events if e.get("kind") == "round_start"]
    assert len(cuts) == 2 and all(len(c["kept"]) == 4 and len(c["carried"]) == 4 for c in cuts)
    assert [len(s["groups"]) for s in starts] == [8, 8, 4] and [s["carried"] for s in starts] == [0, 4, 4]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert [s["samples"] for s in steps] == [16, 16, 16]
    last = steps[-1]["ledger"]
    assert last["trained"] == 48 and not last["discarded"].get("shaping") and last["in_store"] == 0
    assert last["produced"] == last["trained"] + sum(last["discarded"].values()) + last["in_store"]


def test_sorted_trains_a_rounds_groups_as_they_complete(tiny_model, tmp_path):
    """R = 8 prompts a round, U = 4 (2 steps a round): the first step is issued before the round's
    generation is over, each step publishes, and every step is within the bound."""
    run = tmp_path / "run"
    argv = [
        "train",
        f"--run-dir={run}",
        f"--model.path={tiny_model}",
        *TINY_RUN,
        "--flow.steps=4",
        "--eval.n=4",
    ]
    sorted_rl = ["--flow.prompts_per_round=8", "--shaping.name=sorted", "--flow.zero_signal=train"]
    assert main([*argv, *sorted_rl, "--train.loss.correction=tis"]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert [s["samples"] for s in steps] == [16] * 4 and [s["version"] for s in steps] == [1, 2, 3, 4]
    last = steps[-1]["ledger"]
    assert last["trained"] == 64
    assert last["produced"] == last["trained"] + sum(last["discarded"].values()) + last["in_store"]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e.get("kind") == "round_start"]
    issued = [e for e in events if e.get("kind") == "train_issued"]
    first = set(rounds[0]["groups"])
    ready = [e["t"] for e in events if e.get("kind") == "group_ready" and e["group"] in first]
    assert issued[0]["t"] < max(ready), "the first step waited for the whole round"
