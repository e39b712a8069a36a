import itertools

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


@pytest.fixture(autouse=True)
def _checkpoints_load_weights_only(monkeypatch):
    """Every checkpoint a test writes through ``curvkit.checkpoint.save`` must load back with
    ``torch.load(weights_only=True)``, as ``curvkit.checkpoint.load`` does on resume: a checkpoint that holds
    other objects (a dataclass, a numpy array, a curvkit operator) fails the test that writes it, not the
    user's resumed run."""
    from curvkit import checkpoint

    save = checkpoint.save

    def save_and_check(obj, path):
        save(obj, path)
        torch.load(path, weights_only=True)

    monkeypatch.setattr(checkpoint, "save", save_and_check)


# ------------------------------------------------------------------------------ shared tiny models and data
_ACTS = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "sigmoid": torch.nn.Sigmoid}


@pytest.fixture
def make_mlp():
    """Factory of the tiny MLPs the unit tests share: ``make_mlp((4, 5, 3), "relu", seed=0)`` is
    ``Linear(4, 5) - ReLU - Linear(5, 3)`` in float64 with torch's default initialisation after
    ``torch.manual_seed(seed)`` (the global RNG is seeded, so later unseeded draws in a test are
    reproducible too)."""

    def make(sizes=(4, 5, 3), activation="relu", seed=0, dtype=torch.float64):
        torch.manual_seed(seed)
        layers = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(torch.nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(_ACTS[activation]())
        return torch.nn.Sequential(*layers).to(dtype)

    return make


@pytest.fixture
def make_cnn():
    """Factory of the tiny CNN the unit tests share: ``Conv2d(1, 2, 3) - ReLU - MaxPool2d(2) - Flatten -
    Linear(2 * ((image - 2) // 2)^2, classes)`` for (B, 1, image, image) inputs, float64, seeded like
    :func:`make_mlp`."""

    def make(image=8, classes=3, seed=0, dtype=torch.float64):
        torch.manual_seed(seed)
        side = (image - 2) // 2
        return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                   torch.nn.Flatten(), torch.nn.Linear(2 * side * side, classes)).to(dtype)

    return make


@pytest.fixture
def make_batch():
    """Factory of seeded classification data: ``make_batch(n, shape=(4,), classes=3, seed=0)`` returns
    X (n, *shape) float64 standard normal and y (n,) int64 labels in [0, classes), from a private
    generator."""

    def make(n=8, shape=(4,), classes=3, seed=0, dtype=torch.float64):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, *shape, generator=g, dtype=dtype), torch.randint(0, classes, (n,), generator=g)

    return make


@pytest.fixture
def make_linear_tasks():
    """Factory of learnable classification tasks for continual-learning tests: ``make_linear_tasks(num=2,
    n_train=200, n_test=100, d=8, classes=3, uniform=False)`` returns ``num`` tuples (X_train, y_train, X_test,
    y_test), float32 inputs (standard normal, or uniform on [0, 1)) labelled by the argmax of a random linear
    map, one seeded generator for all tasks."""

    def make(num=2, n_train=200, n_test=100, d=8, classes=3, uniform=False):
        g = torch.Generator().manual_seed(0)
        tasks = []
        for _ in range(num):
            n = n_train + n_test
            X = torch.rand(n, d, generator=g) if uniform else torch.randn(n, d, generator=g)
            y = (X @ torch.randn(d, classes, generator=g)).argmax(1)
            tasks.append((X[:n_train], y[:n_train], X[n_train:], y[n_train:]))
        return tasks

    return make


@pytest.fixture
def failing_eigh(monkeypatch):
    """Make ``torch.linalg.eigh`` fail the way LAPACK does on rank-deficient or saturated matrices:
    ``failing_eigh("float32")`` raises ``LinAlgError`` for float32 inputs only (a float64 retry succeeds),
    ``"always"`` for every input, ``"nan"`` returns NaN eigenvectors without raising. Returns the list of
    dtypes eigh was called with (for tests that check the retry order)."""
    real = torch.linalg.eigh

    def install(mode):
        if mode not in ("float32", "always", "nan"):
            raise ValueError(f"unknown failure mode {mode!r}")
        calls = []

        def eigh(M, *args, **kwargs):
            calls.append(M.dtype)
            if mode == "always" or (mode == "float32" and M.dtype == torch.float32):
                raise torch.linalg.LinAlgError("simulated: failed to converge")
            lam, U = real(M, *args, **kwargs)
            return (lam, torch.full_like(U, float("nan"))) if mode == "nan" else (lam, U)

        monkeypatch.setattr(torch.linalg, "eigh", eigh)
        return calls

    return install
