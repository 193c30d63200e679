import pytest


@pytest.fixture(autouse=True)
def _no_calibration(tmp_path, monkeypatch):
    """Tests see the built-in cpu preset, never this machine's saved calibration."""
    monkeypatch.setenv("TAILRACE_CACHE", str(tmp_path / "cache"))
