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


def test_sigterm_exits_143_even_where_a_library_reraised_it_as_a_plain_ctrl_c(monkeypatch):
    """Ray's `ray.get` catches the SIGTERM handler's Terminated and raises a KeyboardInterrupt of its
    own: a Ray run stopped by SIGTERM exited 130, as if Ctrl-C had stopped it (a CI flake). A Ctrl-C in
    a later `main` of the same process is still 130."""
    import os
    import signal
    import time

    from tailrace import cli

    def ray_get(argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        except KeyboardInterrupt:
            raise KeyboardInterrupt() from None

    def ctrl_c(argv):
        raise KeyboardInterrupt()

    monkeypatch.setattr(cli, "_run", ray_get)
    assert cli.main([]) == 143
    monkeypatch.setattr(cli, "_run", ctrl_c)
    assert cli.main([]) == 130
