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
