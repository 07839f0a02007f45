import contextlib
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

# The Triton kernels run on CPU tensors through Triton's interpreter, which Triton reads when a
# kernel module is first imported: set it before any test can import one. On a machine with a
# GPU (benchmarks/run_cuda.sh) they compile natively instead.
# (aftlab imports torch._dynamo, which imports triton: set it before importing aftlab)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aftlab import kernels  # noqa: E402 - after TRITON_INTERPRET


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


#: The longest parametrized ``T`` a test runs on the Triton kernels under the interpreter.
INTERPRETER_MAX_T = 100


def pytest_generate_tests(metafunc):
    """``impl`` runs a test on every implementation of its module's op (``OP``, a name or a
    tuple of names): the C++ kernel and pure PyTorch, and the Triton kernel where the op has one
    (:data:`aftlab.kernels.triton.OPS`; on CPU tensors through Triton's interpreter; an op
    without one runs its C++ kernel there)."""
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "impl" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return  # the test parametrizes impl itself
    if "impl" in metafunc.fixturenames:
        impls = ["cpp", "torch"]
        ops = getattr(metafunc.module, "OP", ())
        if set((ops,) if isinstance(ops, str) else ops) & set(kernels.triton.OPS):
            impls.append("triton")
        metafunc.parametrize("impl", impls, indirect=True)


@pytest.fixture
def impl(request):
    """Run a test on each implementation of an op (see :func:`pytest_generate_tests`).

    Use it with ``pytestmark = pytest.mark.usefixtures("impl")`` in a module whose op has a
    kernel (:data:`aftlab.kernels.OPS`), naming the op ``OP = "aft_simple"``. CI builds the C++
    kernels first (``aftlab kernels`` exits 1 when they cannot run) and installs triton (the
    test extra), so no case is skipped there.
    """
    if request.param == "cpp" and not kernels.load():
        pytest.skip(f"kernels unavailable: {kernels.status()['aft_simple'][1]}")
    if request.param == "triton" and not kernels.triton.load():
        pytest.skip(f"Triton kernels unavailable: {kernels.triton.error()}")
    T = getattr(getattr(request.node, "callspec", None), "params", {}).get("T", 0)
    if request.param == "triton" and kernels.triton.interpreting() and T > INTERPRETER_MAX_T:
        pytest.skip(f"T = {T} under Triton's interpreter (seconds a call): it runs compiled "
                    "on a GPU (benchmarks/run_cuda.sh)")
    on = {"cpp": True, "torch": False, "triton": "triton"}[request.param]
    # Compiled Triton (a GPU, benchmarks/run_cuda.sh): the same tests on CUDA tensors.
    gpu = request.param == "triton" and not kernels.triton.interpreting()
    with kernels.use_kernels(on), torch.device("cuda") if gpu else contextlib.nullcontext():
        yield request.param
