import pytest
import torch


@pytest.fixture
def float64_default():
    """Run a test with float64 as torch's default dtype, restoring the previous default afterwards.

    Use it (``pytestmark = pytest.mark.usefixtures("float64_default")``) instead of calling
    ``torch.set_default_dtype`` at module level, which would leak into every later test module.
    """
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The whole suite runs with one intra-op torch thread.

    The unit tests use tiny models, where a second OpenMP thread only adds spin-waiting (on a shared or
    loaded 2-core machine it made some tests 60x slower). Experiments and benchmarks choose their own
    thread count.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
