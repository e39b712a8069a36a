"""Loaders for users' own copies of notMNIST, SVHN and CIFAR-10 (none of them ships with curvkit).

Every loader takes ``root`` (else its environment variable; empty = unset) and reads the standard
published file formats:

* :func:`notmnist` (``CURVKIT_NOTMNIST_DIR``): either IDX files in the MNIST layout
  (``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``, ``t10k-*``; the common
  "notMNIST in MNIST format" conversion), or the original ``notMNIST_small``/``notMNIST_large`` layout of
  one folder per letter ``A`` ... ``J`` holding 28x28 PNG images (labels 0..9 = A..J; that layout has no
  train/test split, :func:`notmnist` returns all of it with ``split='all'``). The original archives hold
  a few unreadable images: ``skip_corrupt=True`` leaves them out and records their paths in
  :data:`SKIPPED`; the default raises naming the file.
* :func:`svhn` (``CURVKIT_SVHN_DIR``): the cropped-digits MATLAB files ``train_32x32.mat`` /
  ``test_32x32.mat`` (``X`` (32, 32, 3, N) uint8, ``y`` (N, 1) with 10 meaning digit 0, mapped to 0).
* :func:`cifar10` (``CURVKIT_CIFAR10_DIR``): the binary version ``cifar-10-batches-bin/data_batch_{1..5}.bin``,
  ``test_batch.bin`` (records of 1 label byte + 3072 pixel bytes), or the python version
  ``cifar-10-batches-py/data_batch_{1..5}``, ``test_batch`` (read with an unpickler that only builds numpy
  arrays, lists and dicts).

Images come back as uint8 tensors, (N, 28, 28) for notMNIST and (N, 3, 32, 32) for SVHN and CIFAR-10, with
int64 labels. Any unreadable, truncated or inconsistent file raises
:class:`~curvkit.data.idx.DataFileError` naming it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from curvkit.data.idx import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, DataFileError, MissingDataFileError, read_idx

__all__ = ["SKIPPED", "cifar10", "notmnist", "svhn"]

#: paths of images :func:`notmnist` skipped with ``skip_corrupt=True`` (last call)
SKIPPED: list[Path] = []
LETTERS = "ABCDEFGHIJ"


def _root(root: str | os.PathLike[str] | None, env: str, name: str) -> Path:
    if root is None:
        root = os.environ.get(env) or None
    if root is None:
        raise MissingDataFileError(None, f"{name} is not bundled with curvkit: pass root= or set {env} to the "
                                         f"directory holding your copy")
    path = Path(root)
    if not path.is_dir():
        raise MissingDataFileError(path, f"{name} directory does not exist" if not path.exists() else
                                   f"{name} location is not a directory")
    return path


def _first(root: Path, candidates: list[str]) -> Path | None:
    for c in candidates:
        if (root / c).exists():
            return root / c
    return None


# ---------------------------------------------------------------------------------------------- notMNIST
def notmnist(root: str | os.PathLike[str] | None = None, split: Literal["train", "test", "all"] = "train",
             skip_corrupt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """notMNIST letters A-J as ``(X uint8 (N, 28, 28), y int64)`` (module docstring)."""
    base = _root(root, "CURVKIT_NOTMNIST_DIR", "notMNIST")
    prefix = {"train": "train", "test": "t10k"}
    for d in (base, base / "raw"):
        if split in prefix and any((d / f"{prefix[split]}-images-idx3-ubyte{s}").exists() for s in ("", ".gz")):
            def pick(name: str, d: Path = d) -> Path:
                return d / name if (d / name).exists() else d / f"{name}.gz"

            X = read_idx(pick(f"{prefix[split]}-images-idx3-ubyte"), IDX_IMAGES_MAGIC)
            y = read_idx(pick(f"{prefix[split]}-labels-idx1-ubyte"), IDX_LABELS_MAGIC)
            if X.shape[0] != y.shape[0] or X.shape[1:] != (28, 28):
                raise DataFileError(pick(f"{prefix[split]}-labels-idx1-ubyte"),
                                    f"{y.shape[0]} labels for images of shape {X.shape}")
            return torch.from_numpy(X.astype(np.uint8)), torch.from_numpy(y.astype(np.int64))
    folder = _first(base, ["notMNIST_small", "notMNIST_large", "."])
    assert folder is not None
    if not all((folder / c).is_dir() for c in LETTERS):
        raise DataFileError(base, f"no notMNIST {split} IDX files and no letter folders A..J here")
    if split != "all":
        raise DataFileError(base, "the letter-folder layout has no train/test split: call notmnist(split='all') "
                                  "and split it yourself")
    from PIL import Image, UnidentifiedImageError

    SKIPPED.clear()
    images, labels = [], []
    for label, letter in enumerate(LETTERS):
        for path in sorted((folder / letter).iterdir()):
            if not path.is_file():
                continue
            try:
                with Image.open(path) as im:
                    arr = np.asarray(im.convert("L"), dtype=np.uint8)
            except (OSError, UnidentifiedImageError, ValueError) as err:
                if skip_corrupt:
                    SKIPPED.append(path)
                    continue
                raise DataFileError(path, f"unreadable image ({err}); pass skip_corrupt=True to leave it out") from err
            if arr.shape != (28, 28):
                raise DataFileError(path, f"image of size {arr.shape}, expected (28, 28)")
            images.append(arr)
            labels.append(label)
    if not images:
        raise DataFileError(folder, "the letter folders hold no images")
    return torch.from_numpy(np.stack(images)), torch.tensor(labels, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------- SVHN
def svhn(root: str | os.PathLike[str] | None = None, split: Literal["train", "test"] = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """SVHN cropped digits ``(X uint8 (N, 3, 32, 32), y int64 in 0..9)`` from ``{split}_32x32.mat``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    base = _root(root, "CURVKIT_SVHN_DIR", "SVHN")
    path = base / f"{split}_32x32.mat"
    if not path.is_file():
        raise MissingDataFileError(path, "SVHN file not found (expected the cropped-digits format)")
    from scipy.io import loadmat

    try:
        mat = loadmat(path)
    except Exception as err:  # scipy raises ValueError/TypeError/OSError/MatReadError for damaged files
        raise DataFileError(path, f"not a readable MATLAB file ({type(err).__name__}: {err})") from err
    if "X" not in mat or "y" not in mat:
        raise DataFileError(path, f"has no arrays 'X' and 'y' (found {sorted(k for k in mat if not k.startswith('__'))})")
    X, y = np.asarray(mat["X"]), np.asarray(mat["y"]).reshape(-1)
    if X.ndim != 4 or X.shape[:3] != (32, 32, 3) or X.shape[3] != y.shape[0]:
        raise DataFileError(path, f"X has shape {X.shape} and y {y.shape}; expected (32, 32, 3, N) and (N, 1)")
    if y.size and (y.min() < 1 or y.max() > 10):
        raise DataFileError(path, f"labels must lie in 1..10 (10 = digit 0), found {y.min()}..{y.max()}")
    images = torch.from_numpy(np.ascontiguousarray(X.transpose(3, 2, 0, 1)).astype(np.uint8))
    return images, torch.from_numpy((y % 10).astype(np.int64))


# ---------------------------------------------------------------------------------------------- CIFAR-10
class _ArrayUnpickler(pickle.Unpickler):
    """Builds only what CIFAR's python batches contain: dicts, lists, bytes, numpy arrays."""

    _ALLOWED = frozenset({("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                          ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                          ("numpy._core.multiarray", "scalar"), ("copyreg", "_reconstructor")})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _cifar_py(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open("rb") as fh:
            batch = _ArrayUnpickler(io.BytesIO(fh.read()), encoding="bytes").load()
    except Exception as err:
        raise DataFileError(path, f"not a readable CIFAR-10 python batch ({type(err).__name__}: {err})") from err
    data = batch.get(b"data") if isinstance(batch, dict) else None
    labels = batch.get(b"labels") if isinstance(batch, dict) else None
    if data is None or labels is None:
        raise DataFileError(path, "has no b'data' and b'labels' entries")
    data, labels = np.asarray(data, dtype=np.uint8), np.asarray(labels, dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or data.shape[0] != labels.shape[0]:
        raise DataFileError(path, f"data of shape {data.shape} with {labels.shape[0]} labels; expected (N, 3072)")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_bin(path: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % 3073:
        raise DataFileError(path, f"{raw.size} bytes is not a whole number of 3073-byte CIFAR-10 records "
                                  "(truncated or not a CIFAR-10 binary batch)")
    rec = raw.reshape(-1, 3073)
    return rec[:, 1:].reshape(-1, 3, 32, 32), rec[:, 0].astype(np.int64)


def cifar10(root: str | os.PathLike[str] | None = None, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 ``(X uint8 (N, 3, 32, 32), y int64)`` from the binary or the python version."""
    base = _root(root, "CURVKIT_CIFAR10_DIR", "CIFAR-10")
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    bin_dir = _first(base, ["cifar-10-batches-bin", "."])
    py_dir = _first(base, ["cifar-10-batches-py", "."])
    parts = []
    if bin_dir is not None and (bin_dir / f"{names[0]}.bin").exists():
        for n in names:
            p = bin_dir / f"{n}.bin"
            if not p.is_file():
                raise MissingDataFileError(p, "CIFAR-10 binary batch missing")
            parts.append(_cifar_bin(p))
    elif py_dir is not None and (py_dir / names[0]).exists():
        for n in names:
            p = py_dir / n
            if not p.is_file():
                raise MissingDataFileError(p, "CIFAR-10 python batch missing")
            parts.append(_cifar_py(p))
    else:
        raise MissingDataFileError(base, f"no CIFAR-10 {'training' if train else 'test'} batches here "
                                         "(cifar-10-batches-bin/*.bin or cifar-10-batches-py/*)")
    X = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    if y.size and (y.min() < 0 or y.max() > 9):
        raise DataFileError(base, f"labels outside 0..9 ({y.min()}..{y.max()})")
    return torch.from_numpy(np.ascontiguousarray(X)), torch.from_numpy(y)
