"""`tailrace report RUN_A RUN_B`: one page comparing runs, timed to a held-out accuracy."""

from tailrace.cli import main
from tailrace.metrics import time_to_accuracy
from tailrace.records import EvalRecord, dumps
from tailrace.sim.scenario import load_scenario, simulate
from tests.report.test_trace import SMALL


def test_time_to_accuracy_is_the_first_evaluation_at_or_above_the_target():
    points = [(0.0, 0.50), (30.0, 0.62), (60.0, 0.71), (90.0, 0.69), (120.0, 0.80)]
    assert time_to_accuracy(points, 0.70) == 60.0
    assert time_to_accuracy(points, 0.62) == 30.0  # reaching it exactly counts
    assert time_to_accuracy(list(reversed(points)), 0.70) == 60.0  # in time order, whatever the input order
    assert time_to_accuracy(points, 0.81) is None


def test_report_of_several_runs_writes_one_page_with_their_times_to_the_target(tmp_path):
    runs = []
    for name, mode, accs in (("a", "sync", (0.5, 0.6, 0.8)), ("b", "pipe", (0.5, 0.7, 0.75))):
        run = tmp_path / name
        simulate(load_scenario(None, [*SMALL, f"--flow.mode={mode}"]), run)
        with open(run / "metrics.jsonl", "a") as f:
            for i, acc in enumerate(accs):
                summary = {"accuracy": acc, "n": 512, "p50": 10.0, "p99": 20.0, "max": 30}
                f.write(dumps(EvalRecord("periodic", 2 * i, summary, version=i, wall_s=10.0 * i)) + "\n")
        runs.append(str(run))
    out = tmp_path / "cmp.html"
    assert main(["report", *runs, "--out", str(out), "--target", "0.7"]) == 0
    page = out.read_text()
    assert "2 runs compared" in page and "s to 0.700" in page
    # a reaches 0.7 at its third evaluation (wall 20), b at its second (wall 10)
    rows = page.split("<tr>")[2:]
    assert ">20.0</td></tr>" in rows[0] and ">10.0</td></tr>" in rows[1]
    assert page.count("<img") >= 3
    assert main(["report", *runs, "--target", "7"]) == 2
