"""Policy tests run on one intra-op thread: small networks are faster and steadier that way here."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Small networks run faster and steadier on one intra-op thread on these shared machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
