"""The study command run in process (``--workers 0``) sets torch's thread count, as a worker would:
put it back after each test so that the tests after these keep every core."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _torch_threads_put_back():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
