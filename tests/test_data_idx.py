"""IDX reading/writing and the MNIST / Fashion-MNIST loaders on small user-supplied fixture files."""

from __future__ import annotations

import dataclasses
import gzip
import shutil
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvkit.data import DataFileError, MissingDataFileError, fashion_mnist, mnist, read_idx, write_idx
from curvkit.data import idx_datasets as idd
from curvkit.data.idx import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, md5_hex

BUNDLED = idd.BUNDLED_DIR / "mnist"

# ---------------------------------------------------------------------------------------------- IDX


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(["u1", "i1", "i2", "i4", "f4", "f8"]),
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    gz=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_idx_round_trip(tmp_path_factory, dtype, shape, gz, seed):
    rng = np.random.default_rng(seed)
    arr = (rng.standard_normal(shape) * 100).astype(dtype)
    path = tmp_path_factory.mktemp("idx") / ("a.idx.gz" if gz else "a.idx")
    write_idx(path, arr)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == gz
    out = read_idx(path)
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)
    assert out.flags.writeable


def test_idx_mnist_layout_and_magic(tmp_path):
    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    write_idx(tmp_path / "img", torch.from_numpy(images))  # torch input accepted too
    data = (tmp_path / "img").read_bytes()
    # magic 2051 then big-endian uint32 dims, then row-major pixels: the published MNIST layout
    assert data[:16] == (2051).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (2, 28, 28))
    assert data[16:] == images.tobytes() and len(data) == 16 + images.size
    np.testing.assert_array_equal(read_idx(tmp_path / "img", expected_magic=IDX_IMAGES_MAGIC), images)
    with pytest.raises(DataFileError, match=r"wrong magic number 2051.*expected 2049") as err:
        read_idx(tmp_path / "img", expected_magic=IDX_LABELS_MAGIC)
    assert str(tmp_path / "img") in str(err.value) and err.value.path == tmp_path / "img"


def test_idx_gzip_detected_by_content_not_name(tmp_path):
    write_idx(tmp_path / "labels", np.array([1, 2, 3], np.uint8), compress=True)
    np.testing.assert_array_equal(read_idx(tmp_path / "labels"), [1, 2, 3])


def _labels_file(tmp_path, name="labels-idx1-ubyte", values=(0, 1, 2, 3, 4)):
    path = tmp_path / name
    write_idx(path, np.array(values, np.uint8))
    return path


def _expect_error(path, match, **kwargs):
    with pytest.raises(DataFileError, match=match) as err:
        read_idx(path, **kwargs)
    assert str(path) in str(err.value), "the error must name the file"
    return err.value


def test_idx_missing_file(tmp_path):
    err = _expect_error(tmp_path / "nope.gz", "does not exist")
    assert isinstance(err, MissingDataFileError) and isinstance(err, FileNotFoundError)


def test_idx_directory_instead_of_file(tmp_path):
    _expect_error(tmp_path, "is a directory")


def test_idx_truncated_body(tmp_path):
    path = _labels_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-1])
    _expect_error(path, r"truncated: header declares 5 uint8 values, i.e. 13 bytes.*holds 12 bytes")


def test_idx_trailing_bytes(tmp_path):
    path = _labels_file(tmp_path)
    path.write_bytes(path.read_bytes() + b"\x00")
    _expect_error(path, "wrong length")


def test_idx_truncated_header(tmp_path):
    (tmp_path / "h").write_bytes(bytes([0, 0, 8, 3]) + (60000).to_bytes(4, "big"))
    _expect_error(tmp_path / "h", "truncated header: 3 dimensions need 16 header bytes, file holds 8")
    (tmp_path / "tiny").write_bytes(b"\x00\x00")
    _expect_error(tmp_path / "tiny", "too short")


@pytest.mark.parametrize(
    "magic", [bytes([1, 0, 8, 1]), bytes([0, 0, 0x0A, 1]), bytes([0, 0, 8, 0]), b"PK\x03\x04"]
)
def test_idx_not_idx(tmp_path, magic):
    (tmp_path / "x").write_bytes(magic + bytes(8))
    _expect_error(tmp_path / "x", "not an IDX file")


def test_idx_bad_gzip(tmp_path):
    raw = _labels_file(tmp_path, "raw")
    # a .gz name with uncompressed content
    (tmp_path / "plain.gz").write_bytes(raw.read_bytes())
    _expect_error(tmp_path / "plain.gz", "not gzip-compressed")
    # a cut gzip stream
    gz = gzip.compress(bytes([0, 0, 8, 1]) + (2000).to_bytes(4, "big") + bytes(range(250)) * 8)
    (tmp_path / "cut.gz").write_bytes(gz[: len(gz) // 2])
    _expect_error(tmp_path / "cut.gz", "corrupt or truncated gzip")
    # a damaged gzip stream (CRC / deflate error)
    damaged = bytearray(gz)
    damaged[len(gz) // 2] ^= 0xFF
    damaged[-6] ^= 0xFF
    (tmp_path / "damaged.gz").write_bytes(bytes(damaged))
    _expect_error(tmp_path / "damaged.gz", "corrupt or truncated gzip")


def test_idx_md5(tmp_path):
    path = _labels_file(tmp_path, "l.gz")
    content = gzip.decompress(path.read_bytes())
    np.testing.assert_array_equal(read_idx(path, md5=md5_hex(content).upper()), [0, 1, 2, 3, 4])
    _expect_error(path, "md5 of the decompressed content", md5="0" * 32)


def test_write_idx_rejects_unsupported(tmp_path):
    with pytest.raises(TypeError, match=r"no IDX type code"):
        write_idx(tmp_path / "x", np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"1 to 255 dimensions"):
        write_idx(tmp_path / "x", np.zeros((), np.uint8))


# ------------------------------------------------------------------------ MNIST-style user directories


def _write_split(directory, train=True, n=5, gz=True, seed=0, image_size=28, max_label=9, n_labels=None):
    """Small fake MNIST split with the standard file names; returns (images, labels) arrays."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, image_size, image_size), dtype=np.uint8)
    labels = rng.integers(0, max_label + 1, n_labels or n, dtype=np.uint8)
    prefix, ext = ("train" if train else "t10k"), (".gz" if gz else "")
    write_idx(directory / f"{prefix}-images-idx3-ubyte{ext}", images)
    write_idx(directory / f"{prefix}-labels-idx1-ubyte{ext}", labels)
    return images, labels


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("CURVKIT_MNIST_DIR", raising=False)
    monkeypatch.delenv("CURVKIT_FASHION_MNIST_DIR", raising=False)


@pytest.mark.parametrize("layout", [".", "raw", "MNIST/raw"])
@pytest.mark.parametrize("gz", [True, False])
def test_mnist_user_dir_layouts(tmp_path, no_env, layout, gz):
    images, labels = _write_split(tmp_path / layout, train=False, gz=gz)
    X, y = mnist(train=False, root=tmp_path)
    assert X.dtype == torch.uint8 and X.shape == (5, 28, 28) and y.dtype == torch.int64
    np.testing.assert_array_equal(X.numpy(), images)
    np.testing.assert_array_equal(y.numpy(), labels)
    # the other split is absent: an error, never the bundled copy
    with pytest.raises(DataFileError, match=r"no MNIST train files"):
        mnist(train=True, root=tmp_path)


def test_mnist_env_var(tmp_path, monkeypatch):
    images, _ = _write_split(tmp_path / "env", n=3)
    _write_split(tmp_path / "arg", n=4)
    monkeypatch.setenv("CURVKIT_MNIST_DIR", str(tmp_path / "env"))
    X, _ = mnist()
    np.testing.assert_array_equal(X.numpy(), images)
    assert mnist(root=tmp_path / "arg")[0].shape[0] == 4, "root= takes precedence over the env var"
    monkeypatch.setenv("CURVKIT_MNIST_DIR", str(tmp_path / "missing"))
    with pytest.raises(MissingDataFileError, match=r"environment variable CURVKIT_MNIST_DIR.*does not exist"):
        mnist()
    monkeypatch.setenv("CURVKIT_MNIST_DIR", "")  # empty = unset -> the bundled copy
    assert mnist(train=False)[0].shape == (10000, 28, 28)


def test_mnist_unusable_user_dir_is_an_error(tmp_path, no_env):
    with pytest.raises(MissingDataFileError, match=r"does not exist") as err:
        mnist(root=tmp_path / "missing")
    assert str(tmp_path / "missing") in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFileError, match=r"no MNIST train files .* looked in") as err:
        mnist(root=tmp_path / "empty")
    assert str(tmp_path / "empty") in str(err.value)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(DataFileError, match=r"not a directory"):
        mnist(root=tmp_path / "file")


def test_mnist_partial_or_inconsistent_files(tmp_path, no_env):
    _write_split(tmp_path / "a")
    (tmp_path / "a" / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(MissingDataFileError, match=r"not train-labels-idx1-ubyte\[.gz\]"):
        mnist(root=tmp_path / "a")
    _write_split(tmp_path / "b", n=5, n_labels=4)
    with pytest.raises(DataFileError, match=r"holds 4 labels but train-images-idx3-ubyte.gz holds 5 images"):
        mnist(root=tmp_path / "b")
    _write_split(tmp_path / "c", image_size=32)
    with pytest.raises(DataFileError, match=r"images have size \(32, 32\)"):
        mnist(root=tmp_path / "c")
    _write_split(tmp_path / "d", max_label=12, n=50)
    with pytest.raises(DataFileError, match=r"out of range 0..9"):
        mnist(root=tmp_path / "d")
    _write_split(tmp_path / "e")
    swapped = tmp_path / "e" / "train-labels-idx1-ubyte.gz"
    shutil.copy(tmp_path / "e" / "train-images-idx3-ubyte.gz", swapped)
    with pytest.raises(DataFileError, match=r"wrong magic number 2051") as err:
        mnist(root=tmp_path / "e")
    assert str(swapped) in str(err.value)


def test_mnist_verify_published_md5(tmp_path, no_env):
    """verify=True accepts the published test files, raw or recompressed, and rejects a modified copy."""
    raw = tmp_path / "raw_layout" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        shutil.copy(BUNDLED / name, raw / name)
    X, y = mnist(train=False, root=tmp_path / "raw_layout", verify=True)
    Xb, yb = mnist(train=False)
    assert torch.equal(X, Xb) and torch.equal(y, yb)

    labels = gzip.decompress((BUNDLED / "t10k-labels-idx1-ubyte.gz").read_bytes())
    images = gzip.decompress((BUNDLED / "t10k-images-idx3-ubyte.gz").read_bytes())
    recompressed = tmp_path / "recompressed"
    recompressed.mkdir()
    (recompressed / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(labels, compresslevel=1, mtime=0))
    (recompressed / "t10k-images-idx3-ubyte").write_bytes(images)  # uncompressed is fine too
    assert torch.equal(mnist(train=False, root=recompressed, verify=True)[1], yb)

    tampered = bytearray(labels)
    tampered[100] = (tampered[100] + 1) % 10
    (recompressed / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(tampered)))
    assert mnist(train=False, root=recompressed)[1][92] == (int(yb[92]) + 1) % 10  # loads unverified
    with pytest.raises(DataFileError, match=r"md5 of the decompressed content .* published MNIST") as err:
        mnist(train=False, root=recompressed, verify=True)
    assert str(recompressed / "t10k-labels-idx1-ubyte.gz") in str(err.value)


def test_bundled_copy_is_always_verified(tmp_path, no_env, monkeypatch):
    fake = tmp_path / "bundle"
    _write_split(fake, train=False)
    monkeypatch.setattr(idd, "_MNIST", dataclasses.replace(idd._MNIST, bundled_dir=fake))
    idd._bundled_arrays.cache_clear()
    try:
        with pytest.raises(DataFileError, match=r"md5 of the decompressed content"):
            mnist(train=False)
        with pytest.raises(MissingDataFileError, match=r"bundled MNIST file is missing.*CURVKIT_MNIST_DIR"):
            mnist(train=True)
    finally:
        idd._bundled_arrays.cache_clear()


def test_fashion_mnist_user_files(tmp_path, no_env, monkeypatch):
    with pytest.raises(MissingDataFileError, match=r"does not bundle Fashion-MNIST.*CURVKIT_FASHION_MNIST_DIR"):
        fashion_mnist()
    images, labels = _write_split(tmp_path / "FashionMNIST" / "raw", train=True)
    X, y = fashion_mnist(root=tmp_path)
    np.testing.assert_array_equal(X.numpy(), images)
    np.testing.assert_array_equal(y.numpy(), labels)
    monkeypatch.setenv("CURVKIT_FASHION_MNIST_DIR", str(tmp_path))
    assert torch.equal(fashion_mnist()[0], X)
    with pytest.raises(DataFileError, match=r"differs from the published Fashion-MNIST"):
        fashion_mnist(verify=True)
    # with the fixture's own archive md5s registered as the published ones, verification passes:
    raw = tmp_path / "FashionMNIST" / "raw"
    files = {
        key: dataclasses.replace(spec, gz_md5=md5_hex((raw / f"{spec.name}.gz").read_bytes()))
        for key, spec in idd._FASHION_MNIST.files.items()
        if key[0]
    }
    monkeypatch.setattr(idd, "_FASHION_MNIST", dataclasses.replace(idd._FASHION_MNIST, files=files))
    assert torch.equal(fashion_mnist(verify=True)[1], y)
    # raw (uncompressed) Fashion-MNIST files have no published md5
    _write_split(tmp_path / "plain", gz=False)
    assert fashion_mnist(root=tmp_path / "plain")[0].shape == (5, 28, 28)
    with pytest.raises(DataFileError, match=r"cannot verify"):
        fashion_mnist(root=tmp_path / "plain", verify=True)


def test_gz_preferred_over_raw(tmp_path, no_env):
    images, _ = _write_split(tmp_path, gz=True, seed=1)
    _write_split(tmp_path, gz=False, seed=2)
    np.testing.assert_array_equal(mnist(root=tmp_path)[0].numpy(), images)


def test_digits_without_sklearn(monkeypatch):
    from curvkit.data import digits

    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match=r"pip install scikit-learn"):
        digits()
