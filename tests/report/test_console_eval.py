"""An evaluation shows its progress (with an ETA) and leaves no line behind."""

import io

from rich.console import Console

from tailrace.report.console import ConsoleUI


def test_an_evaluation_bar_advances_and_goes_away():
    buf = io.StringIO()
    ui = ConsoleUI(Console(file=buf, force_terminal=True, width=100))
    for done in (3, 10, 16):
        ui.evaluating("base", done, 16)
    assert ui._eval is None and "eval (base)" in buf.getvalue()


def test_quiet_runs_show_no_evaluation_bar():
    buf = io.StringIO()
    ui = ConsoleUI(Console(file=buf, force_terminal=True, width=100), quiet=True)
    ui.evaluating("final", 4, 16)
    assert buf.getvalue() == ""
