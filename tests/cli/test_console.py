"""What the command line prints is text: square brackets in paths and messages print as they are."""

import json

from tailrace.cli import main

ODD = "x[/x][bold]y"


def test_a_path_with_markup_prints_verbatim_in_an_error(capsys, tmp_path):
    rc = main(["report", str(tmp_path / ODD)])
    out = capsys.readouterr()
    assert rc == 2 and ODD in out.out + out.err


def test_a_path_with_markup_prints_verbatim_in_normal_output(capsys, tmp_path, monkeypatch):
    from tailrace.config import ArchConfig, SFTConfig
    from tailrace.runtime.warmstart import warm_start_dir

    monkeypatch.setenv("TAILRACE_CACHE", str(tmp_path / ODD))
    cached = warm_start_dir(ArchConfig(), SFTConfig())
    cached.mkdir(parents=True)
    (cached / "warmstart.json").write_text(json.dumps({}))
    rc = main(["sft"])
    out = capsys.readouterr()
    assert rc == 0 and str(cached) in out.out.replace("\n", "")
