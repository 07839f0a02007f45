"""Shared fixtures of the op tests."""

import pytest

from aftlab import kernels


@pytest.fixture(params=["kernel", "pytorch"])
def impl(request):
    """Run a test on both implementations of an op: the C++ kernel and pure PyTorch.

    Use it with ``pytestmark = pytest.mark.usefixtures("impl")`` in a module whose op has a
    kernel (:data:`aftlab.kernels.OPS`). CI builds the kernels first (``aftlab kernels`` exits 1
    when they cannot run), so the kernel case is never skipped there.
    """
    if request.param == "kernel" and not kernels.load():
        pytest.skip(f"kernels unavailable: {kernels.status()['aft_simple'][1]}")
    with kernels.use_kernels(request.param == "kernel"):
        yield request.param
