"""`device`: auto picks CUDA only when torch sees a GPU; a GPU that is not there is one clear line."""

import pytest
import torch

from tailrace.common import ConfigError
from tailrace.config import load_config
from tailrace.runtime.procs import resolve_device, resolve_dtype


def test_auto_follows_torch_and_cpu_is_cpu():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


def test_engines_default_to_bf16_on_a_gpu_with_native_bf16_and_to_fp32_elsewhere(monkeypatch):
    assert [resolve_dtype(d, "cpu") for d in ("auto", "float32", "bfloat16")] == [
        "float32",
        "float32",
        "bfloat16",
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, auto in (((9, 0), "bfloat16"), ((8, 0), "bfloat16"), ((7, 5), "float32")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert (resolve_dtype("auto", "cuda:0"), resolve_dtype("float32", "cuda")) == (auto, "float32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a Ray driver without a GPU of its own
    assert resolve_dtype("auto", "cuda") == "bfloat16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_missing_gpu_is_a_config_error_naming_the_fix():
    with pytest.raises(ConfigError, match=r"device=cuda:1: torch sees 0 CUDA device.*device=cpu"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "tpu", ""])
def test_an_unknown_device_is_rejected(bad):
    with pytest.raises(ConfigError, match="use auto, cpu, cuda or cuda:N"):
        load_config(None, [f"--device={bad}"])


def test_cuda_memory_available_counts_what_torchs_allocator_holds_unused(monkeypatch):
    """An engine's first version frees the weights it fuses into torch's cache, not to the device: a
    KV pool sized by the device's free memory alone would be smaller by them."""
    from tailrace.model.device import available_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (100 << 20, 200 << 20))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 50 << 20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 30 << 20)
    assert available_bytes(torch.device("cuda")) == 120 << 20
