"""The bundled Kuzushiji-MNIST test set (Clanuwat et al. 2018; CC BY-SA 4.0), an out-of-distribution set
for models trained on MNIST: 10,000 28x28 uint8 images of cursive Japanese characters, 10 balanced classes.

The two ``.npz`` files (array ``arr_0`` each) are identical to the published ones and are md5-verified
the first time they are loaded in a process; the decoded arrays are then cached.
"""

from __future__ import annotations

import functools
import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from curvkit.data.idx import DataFileError, MissingDataFileError, md5_hex

__all__ = ["kmnist_test", "read_npz_array"]

KMNIST_DIR = Path(__file__).resolve().parent / "bundled" / "kmnist"
_FILES = {
    "images": ("kmnist-test-imgs.npz", "dace6de62ca8b90843cc45366337d02e"),
    "labels": ("kmnist-test-labels.npz", "3ae489a79983d0fe386152684e3b5412"),
}


def read_npz_array(path: str | os.PathLike[str], key: str = "arr_0", md5: str | None = None) -> np.ndarray:
    """Array ``key`` of an ``.npz`` file (no pickles), optionally checking the file's md5 first.

    A missing, unreadable or corrupt file, a missing key or an md5 mismatch raises :class:`DataFileError`.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingDataFileError(path, "file does not exist" if not path.exists() else "is not a file")
    if md5 is not None:
        got = md5_hex(path.read_bytes())
        if got != md5.lower():
            raise DataFileError(path, f"md5 is {got}, expected {md5.lower()} (corrupt or modified file)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            if key not in npz.files:
                raise DataFileError(path, f"has no array {key!r} (arrays: {npz.files})")
            return npz[key]
    except DataFileError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise DataFileError(path, f"not a readable .npz file ({err})") from err


@functools.lru_cache(maxsize=2)
def _kmnist_arrays(directory: Path, verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    (img_name, img_md5), (lab_name, lab_md5) = _FILES["images"], _FILES["labels"]
    images = read_npz_array(directory / img_name, md5=img_md5 if verify else None)
    labels = read_npz_array(directory / lab_name, md5=lab_md5 if verify else None)
    if images.shape != (10000, 28, 28) or images.dtype != np.uint8:
        raise DataFileError(directory / img_name, f"expected uint8 (10000, 28, 28), got {images.dtype} {images.shape}")
    if labels.shape != (10000,) or labels.dtype.kind not in "ui" or labels.min() < 0 or labels.max() > 9:
        raise DataFileError(directory / lab_name, f"expected 10000 integer labels in 0..9, got {labels.dtype} {labels.shape}")
    return images, labels


def kmnist_test() -> tuple[torch.Tensor, torch.Tensor]:
    """The bundled KMNIST test set as ``(X, y)``: X uint8 (10000, 28, 28), y int64 (10000,) in 0..9."""
    images, labels = _kmnist_arrays(KMNIST_DIR)
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))
