"""Bundled data sets, transforms, seeded synthetic generators and mini-batching."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from curvkit.data import DataFileError, MissingDataFileError, digits, kmnist_test, mnist
from curvkit.data import kmnist as kmnist_module
from curvkit.data.idx_datasets import BUNDLED_DIR
from curvkit.data.kmnist import read_npz_array
from curvkit.data.loader import iterate_batches, num_batches, train_test_split
from curvkit.data.synthetic import classification, regression, teacher_student
from curvkit.data.transforms import flatten, pad, permute_pixels, pixel_permutation, to_unit

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.fixture(scope="module")
def mnist_train():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CURVKIT_MNIST_DIR", raising=False)
        return mnist(train=True)


# ------------------------------------------------------------------------------------ bundled data


def test_bundled_mnist_train(mnist_train):
    X, y = mnist_train
    assert X.shape == (60000, 28, 28) and X.dtype == torch.uint8
    assert y.shape == (60000,) and y.dtype == torch.int64
    assert torch.bincount(y, minlength=10).tolist() == MNIST_TRAIN_COUNTS
    # pixel statistics on the 0..255 scale, from the histogram (no float copy of 47M pixels)
    hist = torch.bincount(X.reshape(-1).to(torch.int32), minlength=256).double()
    values = torch.arange(256, dtype=torch.float64)
    mean = (hist * values).sum() / hist.sum()
    std = torch.sqrt((hist * (values - mean) ** 2).sum() / hist.sum())
    assert round(float(mean), 3) == 33.318 and round(float(std), 3) == 78.567
    assert int(X.min()) == 0 and int(X.max()) == 255


def test_bundled_mnist_test_and_fresh_tensors(monkeypatch):
    monkeypatch.delenv("CURVKIT_MNIST_DIR", raising=False)
    X, y = mnist(train=False)
    assert X.shape == (10000, 28, 28) and X.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.bincount(y, minlength=10).tolist() == MNIST_TEST_COUNTS
    X[:] = 0  # callers own their tensors: the cached copy is unaffected
    assert int(mnist(train=False)[0].sum()) > 0


@pytest.mark.parametrize("train", [True, False])
def test_bundled_files_pass_published_md5(mnist_train, train):
    """The bundled directory as a user directory with verify=True: every file matches the published md5."""
    X, y = mnist(train=train, root=BUNDLED_DIR / "mnist", verify=True)
    if train:
        assert torch.equal(X, mnist_train[0]) and torch.equal(y, mnist_train[1])
    else:
        assert X.shape == (10000, 28, 28)


def test_bundled_license_notices():
    mnist_license = (BUNDLED_DIR / "mnist" / "LICENSE").read_text()
    for needle in ("LeCun", "Cortes", "Burges", "CC BY-SA 3.0", "creativecommons.org/licenses/by-sa/3.0"):
        assert needle in mnist_license
    kmnist_license = (BUNDLED_DIR / "kmnist" / "LICENSE").read_text()
    for needle in ("CC BY-SA 4.0", "Clanuwat", "2018", "creativecommons.org/licenses/by-sa/4.0"):
        assert needle in kmnist_license


def test_kmnist_test():
    X, y = kmnist_test()
    assert X.shape == (10000, 28, 28) and X.dtype == torch.uint8
    assert y.shape == (10000,) and y.dtype == torch.int64
    assert torch.bincount(y, minlength=10).tolist() == [1000] * 10
    assert abs(float(X.double().mean()) - 47.062) < 1e-3
    assert not torch.equal(X, mnist(train=False)[0])


def test_npz_errors(tmp_path):
    with pytest.raises(MissingDataFileError, match=r"does not exist"):
        read_npz_array(tmp_path / "none.npz")
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 this is not a zip archive")
    with pytest.raises(DataFileError, match=r"not a readable .npz") as err:
        read_npz_array(tmp_path / "bad.npz")
    assert str(tmp_path / "bad.npz") in str(err.value)
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(DataFileError, match=r"has no array 'arr_0'"):
        read_npz_array(tmp_path / "other.npz")
    with pytest.raises(DataFileError, match=r"md5 is"):
        read_npz_array(tmp_path / "other.npz", key="x", md5="0" * 32)
    # a truncated copy of the real KMNIST labels file
    real = (BUNDLED_DIR / "kmnist" / "kmnist-test-labels.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(real[: len(real) // 2])
    with pytest.raises(DataFileError):
        read_npz_array(tmp_path / "cut.npz")


def test_kmnist_shape_validation(tmp_path):
    np.savez(tmp_path / "kmnist-test-imgs.npz", np.zeros((10, 28, 28), np.uint8))
    np.savez(tmp_path / "kmnist-test-labels.npz", np.zeros(10, np.uint8))
    with pytest.raises(DataFileError, match=r"expected uint8 \(10000, 28, 28\)"):
        kmnist_module._kmnist_arrays(tmp_path, verify=False)
    with pytest.raises(DataFileError, match=r"md5 is"):
        kmnist_module._kmnist_arrays(tmp_path, verify=True)


def test_digits():
    from sklearn.datasets import load_digits

    X, y = digits()
    assert X.shape == (1797, 8, 8) and X.dtype == torch.float32 and y.dtype == torch.int64
    assert float(X.min()) == 0.0 and float(X.max()) == 16.0
    ref = load_digits()
    np.testing.assert_array_equal(X.numpy(), ref.images)
    np.testing.assert_array_equal(y.numpy(), ref.target)
    assert digits(dtype=torch.float64)[0].dtype == torch.float64
    with pytest.raises(TypeError, match=r"floating"):
        digits(dtype=torch.int64)


# ------------------------------------------------------------------------------------- transforms


def test_to_unit():
    X = torch.tensor([[0, 51, 255]], dtype=torch.uint8)
    out = to_unit(X)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.2, 1.0]]))
    assert to_unit(X, dtype=torch.float64).dtype == torch.float64
    with pytest.raises(TypeError, match=r"expected uint8"):
        to_unit(out)
    with pytest.raises(TypeError, match=r"floating"):
        to_unit(X, dtype=torch.int32)


def test_pad():
    X = torch.randint(1, 256, (3, 28, 28), dtype=torch.uint8)
    P = pad(X, 2)
    assert P.shape == (3, 32, 32) and P.dtype == torch.uint8
    assert torch.equal(P[:, 2:30, 2:30], X)
    interior = torch.zeros(32, 32, dtype=torch.bool)
    interior[2:30, 2:30] = True
    assert int(P[:, ~interior].abs().sum()) == 0
    assert pad(torch.ones(2, 1, 5, 5), 1).shape == (2, 1, 7, 7)  # (N, C, H, W) works too
    assert torch.equal(pad(X, 0), X)
    with pytest.raises(ValueError, match=r"non-negative int"):
        pad(X, -1)
    with pytest.raises(ValueError, match=r"at least 2 dims"):
        pad(torch.ones(5), 2)


def test_flatten():
    X = torch.arange(2 * 3 * 4).reshape(2, 3, 4)
    F = flatten(X)
    assert F.shape == (2, 12) and F[1].tolist() == list(range(12, 24))  # row-major
    assert flatten(torch.zeros(2, 3, 4, 5)).shape == (2, 60)
    with pytest.raises(ValueError, match=r"\(N, H, W\)"):
        flatten(torch.zeros(2, 784))


def test_pixel_permutation_fixed_seed_and_global_rng_untouched():
    state = torch.get_rng_state()
    torch.manual_seed(1)
    p1 = pixel_permutation(784, seed=3)
    torch.manual_seed(2)
    p2 = pixel_permutation(784, seed=3)
    assert torch.equal(p1, p2), "must not depend on the global RNG"
    assert p1.dtype == torch.int64 and torch.equal(p1.sort().values, torch.arange(784))
    assert not torch.equal(p1, pixel_permutation(784, seed=4))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    pixel_permutation(784, seed=0)
    assert torch.equal(torch.get_rng_state(), before), "must not advance the global RNG"
    torch.set_rng_state(state)
    with pytest.raises(ValueError, match=r"positive int"):
        pixel_permutation(0, seed=0)


def test_permute_pixels():
    X = torch.arange(12.0).reshape(2, 6)
    perm = pixel_permutation(6, seed=0)
    out = permute_pixels(X, perm)
    for j in range(6):
        assert torch.equal(out[:, j], X[:, perm[j]])
    inverse = torch.argsort(perm)
    assert torch.equal(permute_pixels(out, inverse), X)
    with pytest.raises(ValueError, match=r"perm has 5 entries but X_flat has 6"):
        permute_pixels(X, torch.arange(5))
    with pytest.raises(ValueError, match=r"not a permutation"):
        permute_pixels(X, torch.tensor([0, 0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match=r"1-D int64"):
        permute_pixels(X, perm.double())


# -------------------------------------------------------------------------------------- synthetic


def _rng_untouched(fn):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    out = fn()
    assert torch.equal(torch.get_rng_state(), before), "generator must not touch the global RNG"
    return out


def test_regression():
    X, y, W = _rng_untouched(lambda: regression(2000, 5, noise=0.1, seed=7))
    assert X.shape == (2000, 5) and y.shape == (2000, 1) and W.shape == (1, 5) and X.dtype == torch.float64
    X2, y2, W2 = regression(2000, 5, noise=0.1, seed=7)
    assert torch.equal(X, X2) and torch.equal(y, y2) and torch.equal(W, W2)
    assert not torch.equal(X, regression(2000, 5, noise=0.1, seed=8)[0])
    residual = y - X @ W.T
    assert abs(float(residual.std()) - 0.1) < 0.1 * 0.05  # std error of the std ~ 1.6 % at n=2000
    W_hat = torch.linalg.lstsq(X, y).solution.T
    assert float((W_hat - W).abs().max()) < 0.01  # OLS error std ~ 0.1/sqrt(2000) = 0.0022
    Xz, yz, Wz = regression(10, 3, noise=0.0, seed=0, dtype=torch.float32, outputs=2)
    assert yz.shape == (10, 2) and yz.dtype == torch.float32
    torch.testing.assert_close(yz, Xz @ Wz.T)
    with pytest.raises(ValueError, match=r"noise"):
        regression(10, 3, noise=-1.0)
    with pytest.raises(ValueError, match=r"n must be a positive int"):
        regression(0, 3)


def test_classification():
    X, y = _rng_untouched(lambda: classification(3000, 4, num_classes=3, seed=1, separation=3.0))
    assert X.shape == (3000, 4) and y.shape == (3000,) and y.dtype == torch.int64
    assert set(torch.unique(y).tolist()) == {0, 1, 2}
    X2, y2 = classification(3000, 4, num_classes=3, seed=1, separation=3.0)
    assert torch.equal(X, X2) and torch.equal(y, y2)
    means = torch.stack([X[y == k].mean(0) for k in range(3)])
    within = X - means[y]
    # unit within-class covariance (tolerance ~ 6 standard errors of a variance estimate at n=3000)
    torch.testing.assert_close(within.T @ within / 3000, torch.eye(4, dtype=torch.float64), atol=0.16, rtol=0)
    # nearest class mean beats chance clearly at separation 3
    pred = torch.cdist(X, means).argmin(1)
    assert float((pred == y).double().mean()) > 0.7
    with pytest.raises(ValueError, match=r"at least 2"):
        classification(10, 2, num_classes=1)


def test_teacher_student():
    X, y, teacher = _rng_untouched(lambda: teacher_student(50, [400, 300, 2], "tanh", noise=0.0, seed=3))
    assert X.shape == (50, 400) and y.shape == (50, 2) and y.dtype == torch.float64
    assert isinstance(teacher[1], torch.nn.Tanh)
    assert all(not p.requires_grad for p in teacher.parameters())
    torch.testing.assert_close(y, teacher(X))
    X2, y2, teacher2 = teacher_student(50, [400, 300, 2], "tanh", noise=0.0, seed=3)
    assert torch.equal(X, X2) and torch.equal(y, y2)
    assert all(torch.equal(a, b) for a, b in zip(teacher.parameters(), teacher2.parameters()))
    W0 = teacher[0].weight
    assert abs(float(W0.std()) * math.sqrt(400) - 1.0) < 0.02  # N(0, 1/fan_in); 120000 entries
    _, y_noisy, _ = teacher_student(50, [400, 300, 2], "tanh", noise=0.5, seed=3)
    assert not torch.equal(y_noisy, y)
    _, y_other, _ = teacher_student(50, [400, 300, 2], "tanh", seed=4)
    assert not torch.equal(y_other, y)
    _, _, nobias = teacher_student(5, [3, 4, 1], "relu", seed=0, bias=False)
    assert all(layer.bias is None for layer in nobias if isinstance(layer, torch.nn.Linear))


# ----------------------------------------------------------------------------------------- loader


def test_iterate_batches_in_order():
    X, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    batches = list(iterate_batches(X, y, 2, shuffle=False))
    assert [len(b[1]) for b in batches] == [2, 2, 1] == [2, 2, 1][: num_batches(5, 2)]
    assert torch.equal(torch.cat([b[0] for b in batches]), X)
    dropped = list(iterate_batches(X, y, 2, shuffle=False, drop_last=True))
    assert [b[1].tolist() for b in dropped] == [[0, 1], [2, 3]] and num_batches(5, 2, drop_last=True) == 2
    assert list(iterate_batches(X[:0], y[:0], 3)) == []


def test_iterate_batches_shuffled():
    X, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
    run = lambda seed: list(iterate_batches(X, y, 3, generator=torch.Generator().manual_seed(seed)))  # noqa: E731
    batches = run(0)
    seen = torch.cat([b[1] for b in batches])
    assert sorted(seen.tolist()) == list(range(10)) and seen.tolist() != list(range(10))
    for xb, yb in batches:
        assert torch.equal(xb, X[yb]), "X and y rows stay aligned"
    assert all(torch.equal(a[1], b[1]) for a, b in zip(batches, run(0)))
    assert not torch.equal(seen, torch.cat([b[1] for b in run(1)]))
    assert len(list(iterate_batches(X, y, 3, generator=torch.Generator().manual_seed(0), drop_last=True))) == 3


def test_iterate_batches_errors():
    with pytest.raises(ValueError, match=r"same first"):
        list(iterate_batches(torch.zeros(4, 2), torch.zeros(3), 2))
    with pytest.raises(ValueError, match=r"batch_size"):
        list(iterate_batches(torch.zeros(4, 2), torch.zeros(4), 0))


def test_train_test_split():
    X, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
    Xtr, ytr, Xte, yte = train_test_split(X, y, test_fraction=0.3, seed=0)
    assert len(yte) == 3 and len(ytr) == 7
    assert sorted(torch.cat([ytr, yte]).tolist()) == list(range(10))
    assert torch.equal(Xtr, X[ytr]) and torch.equal(Xte, X[yte])
    assert torch.equal(train_test_split(X, y, 0.3, seed=0)[3], yte)
    with pytest.raises(ValueError, match=r"test_fraction"):
        train_test_split(X, y, test_fraction=1.0)
    with pytest.raises(ValueError, match=r"at least one point"):
        train_test_split(X, y, test_fraction=0.01)
