import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These models are tiny: extra threads only add contention (3x slower on a busy 2-core box)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
