import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property tests (tests/ops/test_properties.py): a fixed, derandomized example budget in CI;
# `pytest --hypothesis-profile=dev` (or HYPOTHESIS_PROFILE=dev) searches many more examples.
_FIXTURES = [HealthCheck.function_scoped_fixture]  # seed/thread fixtures: per test, not per example
_PROFILE = {"deadline": None, "print_blob": True, "suppress_health_check": _FIXTURES}
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_PROFILE)
settings.register_profile("dev", max_examples=1000, **_PROFILE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Small tensors run on one thread: no oversubscription of the shared CPUs.

    Use it per module: ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
