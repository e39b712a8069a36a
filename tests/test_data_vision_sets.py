"""Loaders for users' copies of notMNIST, SVHN and CIFAR-10, and the five-task sequence format: tiny files
in the published formats written here, corrupt files raise errors naming the file."""

import pickle

import numpy as np
import pytest
import torch

from curvkit.data import DataFileError
from curvkit.data.idx import write_idx
from curvkit.data.task_sequence import load_task, synthetic_vision_tasks, to_rgb32
from curvkit.data.vision_sets import SKIPPED, cifar10, notmnist, svhn


def test_notmnist_idx_and_letter_folders(tmp_path):
    X = np.random.default_rng(0).integers(0, 255, (6, 28, 28), dtype=np.uint8)
    (tmp_path / "idx").mkdir()
    write_idx(tmp_path / "idx" / "t10k-images-idx3-ubyte.gz", X)
    write_idx(tmp_path / "idx" / "t10k-labels-idx1-ubyte", np.arange(6, dtype=np.uint8))
    Xt, yt = notmnist(tmp_path / "idx", split="test")
    assert torch.equal(Xt, torch.from_numpy(X)) and yt.tolist() == list(range(6))
    from PIL import Image

    root = tmp_path / "folders" / "notMNIST_small"
    for i, letter in enumerate("ABCDEFGHIJ"):
        (root / letter).mkdir(parents=True)
        Image.fromarray(np.full((28, 28), 10 * i, dtype=np.uint8)).save(root / letter / "a.png")
    (root / "C" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(DataFileError, match=r"broken\.png"):
        notmnist(tmp_path / "folders", split="all")
    Xa, ya = notmnist(tmp_path / "folders", split="all", skip_corrupt=True)
    assert Xa.shape == (10, 28, 28) and ya.tolist() == list(range(10)) and int(Xa[3, 0, 0]) == 30
    assert [p.name for p in SKIPPED] == ["broken.png"]
    with pytest.raises(DataFileError, match="no train/test split"):
        notmnist(tmp_path / "folders", split="train")


def test_svhn_mat_files(tmp_path):
    from scipy.io import savemat

    X = np.random.default_rng(0).integers(0, 255, (32, 32, 3, 4), dtype=np.uint8)
    savemat(tmp_path / "test_32x32.mat", {"X": X, "y": np.array([[10], [1], [5], [10]])})
    Xs, ys = svhn(tmp_path, split="test")
    assert Xs.shape == (4, 3, 32, 32) and ys.tolist() == [0, 1, 5, 0]
    assert int(Xs[1, 2, 3, 4]) == int(X[3, 4, 2, 1])
    (tmp_path / "train_32x32.mat").write_bytes(b"garbage")
    with pytest.raises(DataFileError, match=r"train_32x32\.mat"):
        svhn(tmp_path, split="train")


def test_cifar10_binary_and_python_versions(tmp_path):
    rng = np.random.default_rng(0)
    b = tmp_path / "bin" / "cifar-10-batches-bin"
    b.mkdir(parents=True)
    recs = rng.integers(0, 255, (3, 3073), dtype=np.uint8)
    recs[:, 0] = [1, 7, 9]
    recs.tofile(b / "test_batch.bin")
    Xb, yb = cifar10(tmp_path / "bin", train=False)
    assert Xb.shape == (3, 3, 32, 32) and yb.tolist() == [1, 7, 9]
    assert torch.equal(Xb[0].reshape(-1), torch.from_numpy(recs[0, 1:]))
    (b / "test_batch.bin").write_bytes(recs.tobytes()[:-5])
    with pytest.raises(DataFileError, match=r"test_batch\.bin"):
        cifar10(tmp_path / "bin", train=False)
    p = tmp_path / "py" / "cifar-10-batches-py"
    p.mkdir(parents=True)
    data = rng.integers(0, 255, (2, 3072), dtype=np.uint8)
    with (p / "test_batch").open("wb") as fh:
        pickle.dump({b"data": data, b"labels": [3, 4]}, fh)
    Xp, yp = cifar10(tmp_path / "py", train=False)
    assert yp.tolist() == [3, 4] and torch.equal(Xp.reshape(2, -1), torch.from_numpy(data))

    class Evil:
        def __reduce__(self):
            return (print, ("boom",))

    with (p / "test_batch").open("wb") as fh:
        pickle.dump({b"data": Evil(), b"labels": [1]}, fh)
    with pytest.raises(DataFileError, match="refusing"):
        cifar10(tmp_path / "py", train=False)


def test_missing_directories_say_how_to_fix(monkeypatch, tmp_path):
    monkeypatch.delenv("CURVKIT_SVHN_DIR", raising=False)
    with pytest.raises(DataFileError, match="CURVKIT_SVHN_DIR"):
        svhn()
    with pytest.raises(DataFileError, match="does not exist"):
        cifar10(tmp_path / "nope")


def test_sequence_format_and_synthetic_stand_in():
    x = to_rgb32(torch.full((2, 28, 28), 255, dtype=torch.uint8))
    assert x.shape == (2, 3, 32, 32) and float(x[0, 1, 0, 0]) == 0.0 and float(x[0, 2, 2, 2]) == 1.0
    tasks = synthetic_vision_tasks(5, n_train=50, n_test=20, seed=0)
    assert len(tasks) == 5 and tasks[0][0].shape == (50, 3, 32, 32) and tasks[4][3].shape == (20,)
    again = synthetic_vision_tasks(5, n_train=50, n_test=20, seed=0)
    assert torch.equal(tasks[2][0], again[2][0])
    Xtr, _ytr, _Xte, yte = load_task("mnist", max_train=10, max_test=5)
    assert Xtr.shape == (10, 3, 32, 32) and yte.shape == (5,)
