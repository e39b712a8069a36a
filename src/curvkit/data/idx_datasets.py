"""MNIST and Fashion-MNIST loaders: the bundled MNIST copy, or user-supplied IDX files.

Where the files come from (first match wins):

1. ``root`` argument, else
2. the environment variable (``CURVKIT_MNIST_DIR`` / ``CURVKIT_FASHION_MNIST_DIR``; empty = unset), else
3. MNIST only: the copy bundled inside the package (``curvkit/data/bundled/mnist``, CC BY-SA 3.0,
   see the LICENSE file there). Fashion-MNIST is not bundled: without a directory it is an error.

A user directory may hold the standard file names (``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each raw or with
``.gz``) directly, or in torchvision's ``MNIST/raw/`` (``FashionMNIST/raw/``) or a plain ``raw/``
sub-directory. When both ``NAME.gz`` and ``NAME`` exist the ``.gz`` (the published artifact) is read.
A user directory that does not exist, or holds no usable files, is a :class:`DataFileError`; it never
falls back to the bundled copy.

Verification (``verify=True``) compares md5 digests with the published ones. For MNIST it compares the
md5 of the *decompressed* content, which holds for the published ``.gz`` files, for recompressed copies
(the bundled ``train-images`` was recompressed; its content is bit-identical) and for raw files. For
Fashion-MNIST only the md5s of the published ``.gz`` archives are known (Zalando's repository and
torchvision list the same four), so verification needs the ``.gz`` files; a raw Fashion-MNIST file with
``verify=True`` is an error saying so. The bundled MNIST copy is *always* verified (md5 of the
decompressed content, about 0.1 s) the first time it is loaded in a process; its decoded arrays are then
cached and each call returns fresh tensors.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from curvkit.data.idx import (
    IDX_IMAGES_MAGIC,
    IDX_LABELS_MAGIC,
    DataFileError,
    MissingDataFileError,
    decode_idx,
    md5_hex,
    read_bytes,
)

__all__ = ["BUNDLED_DIR", "fashion_mnist", "mnist"]

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"

IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10


@dataclass(frozen=True)
class _FileSpec:
    name: str  # standard file name without .gz
    content_md5: str | None  # md5 of the decompressed (raw IDX) bytes, where published/derivable
    gz_md5: str | None  # md5 of the published .gz archive


@dataclass(frozen=True)
class _DatasetSpec:
    name: str  # for messages
    function: str  # the public loader's name, for messages
    env_var: str
    torchvision_dir: str  # torchvision's root/<dir>/raw layout
    files: dict[tuple[bool, str], _FileSpec]  # (train, "images" | "labels") -> file
    bundled_dir: Path | None
    url: str


_MNIST = _DatasetSpec(
    name="MNIST",
    function="mnist",
    env_var="CURVKIT_MNIST_DIR",
    torchvision_dir="MNIST",
    files={
        # content md5s: published for the raw train-images; the others are the md5s of the decompressed
        # published .gz files (the bundled t10k-images, t10k-labels and train-labels .gz are byte-identical
        # to the published ones, whose .gz md5s are listed here too).
        (True, "images"): _FileSpec(
            "train-images-idx3-ubyte", "6bbc9ace898e44ae57da46a324031adb", "f68b3c2dcbeaaa9fbdd348bbdeb94873"
        ),
        (True, "labels"): _FileSpec(
            "train-labels-idx1-ubyte", "a25bea736e30d166cdddb491f175f624", "d53e105ee54ea40749a09fcbcd1e9432"
        ),
        (False, "images"): _FileSpec(
            "t10k-images-idx3-ubyte", "2646ac647ad5339dbf082846283269ea", "9fb629c4189551a2d022fa330f9573f3"
        ),
        (False, "labels"): _FileSpec(
            "t10k-labels-idx1-ubyte", "27ae3e4e09519cfbb04c329615203637", "ec29112dd5afa0611ce80d1b7f02629c"
        ),
    },
    bundled_dir=BUNDLED_DIR / "mnist",
    url="http://yann.lecun.com/exdb/mnist/",
)

_FASHION_MNIST = _DatasetSpec(
    name="Fashion-MNIST",
    function="fashion_mnist",
    env_var="CURVKIT_FASHION_MNIST_DIR",
    torchvision_dir="FashionMNIST",
    files={
        (True, "images"): _FileSpec("train-images-idx3-ubyte", None, "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        (True, "labels"): _FileSpec("train-labels-idx1-ubyte", None, "25c81989df183df01b3e8a0aad5dffbe"),
        (False, "images"): _FileSpec("t10k-images-idx3-ubyte", None, "bef4ecab320f06d8554ea6380940ec79"),
        (False, "labels"): _FileSpec("t10k-labels-idx1-ubyte", None, "bb300cfdad3c16e7a12a480ee83cd310"),
    },
    bundled_dir=None,
    url="https://github.com/zalandoresearch/fashion-mnist",
)


def _pick(directory: Path, name: str) -> Path | None:
    for candidate in (directory / f"{name}.gz", directory / name):
        if candidate.is_file():
            return candidate
    return None


def _find_files(spec: _DatasetSpec, train: bool, root: Path, origin: str) -> tuple[Path, Path]:
    """Locate the (images, labels) files of one split in a user directory, or raise DataFileError."""
    if not root.exists():
        raise MissingDataFileError(root, f"{spec.name} directory ({origin}) does not exist")
    if not root.is_dir():
        raise DataFileError(root, f"{spec.name} location ({origin}) is not a directory")
    image_name = spec.files[(train, "images")].name
    label_name = spec.files[(train, "labels")].name
    candidates = [root, root / spec.torchvision_dir / "raw", root / "raw"]
    for directory in candidates:
        images, labels = _pick(directory, image_name), _pick(directory, label_name)
        if images is not None and labels is not None:
            return images, labels
        if images is not None or labels is not None:
            missing = label_name if labels is None else image_name
            raise MissingDataFileError(
                directory, f"found the {spec.name} {'images' if images else 'labels'} file but not {missing}[.gz]"
            )
    split = "train" if train else "test"
    looked = ", ".join(str(d) for d in candidates)
    raise DataFileError(
        root,
        f"no {spec.name} {split} files ({image_name}[.gz], {label_name}[.gz]) in this directory ({origin}); "
        f"looked in {looked}",
    )


def _read_verified(path: Path, file_spec: _FileSpec, magic: int, verify: bool, dataset: str) -> np.ndarray:
    file_bytes, content = read_bytes(path)
    if verify:
        compressed = file_bytes[:2] == b"\x1f\x8b"
        if file_spec.content_md5 is not None:
            got = md5_hex(content)
            if got != file_spec.content_md5:
                raise DataFileError(
                    path,
                    f"md5 of the decompressed content is {got}, but the published {dataset} "
                    f"{file_spec.name} has {file_spec.content_md5} (corrupt or modified file)",
                )
        elif compressed and file_spec.gz_md5 is not None:
            got = md5_hex(file_bytes)
            if got != file_spec.gz_md5:
                raise DataFileError(
                    path,
                    f"md5 {got} differs from the published {dataset} {file_spec.name}.gz md5 {file_spec.gz_md5}",
                )
        else:
            raise DataFileError(
                path,
                f"cannot verify: only the md5s of the published {dataset} .gz archives are known; "
                f"point at the original {file_spec.name}.gz, or pass verify=False",
            )
    return decode_idx(content, path, magic)


def _load_pair(spec: _DatasetSpec, train: bool, images_path: Path, labels_path: Path, verify: bool):
    images = _read_verified(images_path, spec.files[(train, "images")], IDX_IMAGES_MAGIC, verify, spec.name)
    labels = _read_verified(labels_path, spec.files[(train, "labels")], IDX_LABELS_MAGIC, verify, spec.name)
    if images.shape[1:] != IMAGE_SHAPE:
        raise DataFileError(images_path, f"images have size {images.shape[1:]}, expected {IMAGE_SHAPE}")
    if labels.shape[0] != images.shape[0]:
        raise DataFileError(
            labels_path, f"holds {labels.shape[0]} labels but {images_path.name} holds {images.shape[0]} images"
        )
    if labels.size and int(labels.max()) >= NUM_CLASSES:
        raise DataFileError(labels_path, f"label {int(labels.max())} out of range 0..{NUM_CLASSES - 1}")
    return images, labels


@functools.lru_cache(maxsize=2)
def _bundled_arrays(train: bool) -> tuple[np.ndarray, np.ndarray]:
    spec = _MNIST
    assert spec.bundled_dir is not None
    paths = [spec.bundled_dir / f"{spec.files[(train, kind)].name}.gz" for kind in ("images", "labels")]
    for path in paths:
        if not path.is_file():
            raise MissingDataFileError(
                path,
                "the bundled MNIST file is missing from this installation; reinstall curvkit, or point "
                f"{spec.env_var} (or root=) at a directory with the MNIST files",
            )
    return _load_pair(spec, train, paths[0], paths[1], verify=True)


def _load(spec: _DatasetSpec, train: bool, root: str | os.PathLike[str] | None, verify: bool):
    if root is not None:
        directory, origin = Path(root), "root argument"
    elif os.environ.get(spec.env_var):
        directory, origin = Path(os.environ[spec.env_var]), f"environment variable {spec.env_var}"
    elif spec.bundled_dir is not None:
        images, labels = _bundled_arrays(bool(train))
        return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))
    else:
        raise MissingDataFileError(
            None,
            f"{spec.function}: no {spec.name} directory given and curvkit does not bundle {spec.name}. "
            f"Download its four IDX files ({spec.url}) and pass {spec.function}(root=DIR) or set "
            f"{spec.env_var}=DIR (the files directly in DIR, or in DIR/{spec.torchvision_dir}/raw or DIR/raw).",
        )
    images_path, labels_path = _find_files(spec, bool(train), directory.expanduser(), origin)
    images, labels = _load_pair(spec, bool(train), images_path, labels_path, verify)
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def mnist(
    train: bool = True, root: str | os.PathLike[str] | None = None, verify: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST as ``(X, y)``: X uint8 (N, 28, 28) pixels 0..255, y int64 (N,) labels 0..9.

    N = 60000 (``train=True``) or 10000. ``root``/``CURVKIT_MNIST_DIR`` select user files (see the
    module docstring for the accepted layouts); without either the bundled copy is loaded (always
    md5-verified, so ``verify`` has no further effect on it). ``verify=True`` checks user files against the
    published md5s of the decompressed content. Problems raise :class:`DataFileError` naming the file.
    """
    return _load(_MNIST, train, root, verify)


def fashion_mnist(
    train: bool = True, root: str | os.PathLike[str] | None = None, verify: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST (Xiao et al. 2017) from user files as ``(X, y)``: X uint8 (N, 28, 28), y int64 (N,).

    Not bundled: give ``root`` or set ``CURVKIT_FASHION_MNIST_DIR``; same layouts as :func:`mnist`.
    ``verify=True`` checks the ``.gz`` files against the published archive md5s (raw files cannot be
    verified and raise :class:`DataFileError`).
    """
    return _load(_FASHION_MNIST, train, root, verify)


def mnist_vectors(train: bool = True, n: int | None = None, padding: int = 0,
                  dtype: torch.dtype = torch.float32, root: str | os.PathLike[str] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST (:func:`mnist`) as flat vectors in [0, 1]: X (N, D) ``dtype``, y int64 (N,); the first ``n``
    images when given, zero-padded by ``padding`` pixels on every side first (``padding=2``: 32x32)."""
    from curvkit.data.transforms import image_vectors

    X, y = mnist(train=train, root=root)
    if n is not None:
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"n must be a positive integer or None, got {n!r}")
        X, y = X[:n], y[:n]
    return image_vectors(X, padding, dtype=dtype), y
