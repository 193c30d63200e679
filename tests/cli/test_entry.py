"""The `tailrace` console script (`cli.entry`) leaves without the interpreter's module teardown, after
the exit handlers ran and stdout was flushed; a live non-daemon thread gets the ordinary exit."""

import subprocess
import sys
import textwrap


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )


def test_entry_flushes_its_output_runs_exit_handlers_and_keeps_the_exit_code(tmp_path):
    mark = tmp_path / "atexit"
    out = run(f"""
        import atexit, sys
        from pathlib import Path
        from tailrace.cli import entry
        atexit.register(lambda: Path({str(mark)!r}).write_text("ran"))
        sys.stdout.write("unflushed, no newline")
        sys.argv = ["tailrace", "no-such-verb"]
        entry()
    """)
    assert out.returncode == 2 and out.stdout.startswith("unflushed, no newline"), out
    assert mark.read_text() == "ran"


def test_entry_waits_for_a_thread_that_is_not_a_daemon(tmp_path):
    done = tmp_path / "done"
    out = run(f"""
        import sys, threading, time
        from pathlib import Path
        from tailrace.cli import entry
        def work():
            time.sleep(0.5)
            Path({str(done)!r}).write_text("done")
        threading.Thread(target=work).start()
        sys.argv = ["tailrace", "--help"]
        entry()
    """)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out
    assert done.read_text() == "done"
