"""`device`: auto picks CUDA only when torch sees a GPU; a GPU that is not there is one clear line."""

import pytest
import torch

from tailrace.common import ConfigError
from tailrace.config import load_config
from tailrace.runtime.procs import resolve_device


def test_auto_follows_torch_and_cpu_is_cpu():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_missing_gpu_is_a_config_error_naming_the_fix():
    with pytest.raises(ConfigError, match=r"device=cuda:1: torch sees 0 CUDA device.*device=cpu"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "tpu", ""])
def test_an_unknown_device_is_rejected(bad):
    with pytest.raises(ConfigError, match="use auto, cpu, cuda or cuda:N"):
        load_config(None, [f"--device={bad}"])
