import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Decode tests run at one torch thread (the CPU kernels' and the timings' setting), restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
