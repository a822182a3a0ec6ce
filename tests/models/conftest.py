import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are tiny: a second intra-op thread buys nothing, and on a shared 2-core box
    it spin-waits against other processes (measured: 4.5 s alone, 46 s under load, 7 s with one
    thread). Restored afterwards so other test folders keep their setting."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
