"""The study command run in process (``--workers 0``) sets torch's thread count, as a worker would:
put it back after each test so that the tests after these keep every core. It also leaves the rates
its units measured in this process (``rates._seconds_per_weight``): forget them, so that no test
reads another's."""

import pytest
import torch

from cl_streamkl.experiment.study import rates as study_rates


@pytest.fixture(autouse=True)
def _torch_threads_put_back():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _measured_rates_forgotten():
    yield
    study_rates._seconds_per_weight.clear()
