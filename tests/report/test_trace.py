"""`tailrace trace`: a run directory as a Chrome/Perfetto trace."""

import json

from tailrace.cli import main
from tailrace.records import Finished, Mark, read_events, read_journal
from tailrace.sim.scenario import load_scenario, simulate

SMALL = [
    "--cluster.hardware=h100",
    "--cluster.model=qwen3-1.7b",
    "--cluster.engines=2",
    "--cluster.slots=16",
    "--flow.prompts_per_round=4",
    "--flow.samples_per_prompt=4",
    "--flow.train_batch=8",
    "--flow.steps=4",
    "--lengths={kind: lognormal, median: 800, max_len: 4096, runaway: 0.05, prompt: 128}",
]


def test_trace_has_a_track_per_component_and_each_steps_longest_request(tmp_path):
    run = tmp_path / "run"
    simulate(load_scenario(None, SMALL), run)
    assert main(["trace", str(run)]) == 0
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert {"engine0", "engine1", "trainer", "weight sync", "scheduler", "tail 1"} <= set(names.values())
    spans = [e for e in trace if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    # the longest request of each step is the longest trajectory the step trained
    lengths = {}
    for j in read_journal(run / "journal.jsonl"):
        if isinstance(j, Finished):
            lengths.setdefault(j.trajectory.group, []).append(j.trajectory.length)
    issued = [
        e for e in read_events(run / "events.jsonl") if isinstance(e, Mark) and e.kind == "train_issued"
    ]
    longest = [e for e in spans if names[e["tid"]] == "tail 1"]
    assert len(longest) == len(issued) == 4
    for mark, ev in zip(issued, longest):
        top = max(n for g in mark.data["groups"] for n in lengths[g])
        assert ev["name"].endswith(f": {top} tokens")
