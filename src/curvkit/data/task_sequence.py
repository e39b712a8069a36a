"""The five-dataset sequence of thesis Sec. 5.4.3 (MNIST, notMNIST, Fashion-MNIST, SVHN, CIFAR-10) in one
image format, and a synthetic five-task stand-in.

All tasks are brought to 3 x 32 x 32 float images in [0, 1] (thesis: "zero padded ... replicated over the
three colour channels"): 28 x 28 grey images are zero-padded by 2 pixels on every side and copied to three
channels. Only MNIST ships with curvkit; the others are read from the user's copies
(:mod:`curvkit.data.vision_sets`, :func:`curvkit.data.fashion_mnist`) and :func:`available_tasks` says
which can be loaded. :func:`synthetic_vision_tasks` is a seeded stand-in with the same format: per task
ten random smooth colour prototypes (8 x 8 noise upsampled to 32 x 32), images = prototype + Gaussian
pixel noise whose level grows with the task index (later tasks are harder, as in the real sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from curvkit.data.idx import DataFileError

__all__ = ["SEQUENCE", "available_tasks", "load_task", "synthetic_vision_tasks", "to_rgb32"]

SEQUENCE = ("mnist", "notmnist", "fashion_mnist", "svhn", "cifar10")
Dataset = tuple[Tensor, Tensor, Tensor, Tensor]


def to_rgb32(X: Tensor) -> Tensor:
    """uint8 images (N, 28, 28) or (N, 3, 32, 32) -> float32 (N, 3, 32, 32) in [0, 1]."""
    x = X.float() / 255.0 if not X.is_floating_point() else X.float()
    if x.dim() == 3 and x.shape[1:] == (28, 28):
        return F.pad(x, (2, 2, 2, 2))[:, None].expand(-1, 3, -1, -1).contiguous()
    if x.dim() == 4 and x.shape[1:] == (3, 32, 32):
        return x
    raise ValueError(f"expected (N, 28, 28) grey or (N, 3, 32, 32) colour images, got {tuple(X.shape)}")


def _subset(X: Tensor, y: Tensor, n: int | None) -> tuple[Tensor, Tensor]:
    return (X, y) if n is None else (X[:n], y[:n])


def load_task(name: str, max_train: int | None = None, max_test: int | None = None, seed: int = 0) -> Dataset:
    """One task of :data:`SEQUENCE` as ``(X_train, y_train, X_test, y_test)`` in the common format. notMNIST
    in the letter-folder layout is split 85/15 by a permutation seeded ``seed``."""
    from curvkit.data import fashion_mnist, mnist
    from curvkit.data.vision_sets import cifar10, notmnist, svhn

    if name == "mnist":
        tr, te = mnist(train=True), mnist(train=False)
    elif name == "fashion_mnist":
        tr, te = fashion_mnist(train=True), fashion_mnist(train=False)
    elif name == "svhn":
        tr, te = svhn(split="train"), svhn(split="test")
    elif name == "cifar10":
        tr, te = cifar10(train=True), cifar10(train=False)
    elif name == "notmnist":
        try:
            tr, te = notmnist(split="train"), notmnist(split="test")
        except DataFileError as err:
            if "no train/test split" not in str(err):
                raise
            X, y = notmnist(split="all", skip_corrupt=True)
            perm = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(seed))
            cut = int(0.85 * X.shape[0])
            tr, te = (X[perm[:cut]], y[perm[:cut]]), (X[perm[cut:]], y[perm[cut:]])
    else:
        raise ValueError(f"unknown task {name!r}; choose from {SEQUENCE}")
    Xtr, ytr = _subset(*tr, max_train)
    Xte, yte = _subset(*te, max_test)
    return to_rgb32(Xtr), ytr.long(), to_rgb32(Xte), yte.long()


def available_tasks(names: Sequence[str] = SEQUENCE) -> dict[str, str | None]:
    """name -> None if its files can be found, else the reason (the loader's error message)."""
    from curvkit.data import fashion_mnist
    from curvkit.data.vision_sets import cifar10, notmnist, svhn

    probes = {"mnist": lambda: None, "fashion_mnist": lambda: fashion_mnist(train=False),
              "svhn": lambda: svhn(split="test"), "cifar10": lambda: cifar10(train=False),
              "notmnist": lambda: notmnist(split="test")}
    out: dict[str, str | None] = {}
    for n in names:
        try:
            probes[n]()
            out[n] = None
        except DataFileError as err:
            if n == "notmnist" and "no train/test split" in str(err):
                out[n] = None
            else:
                out[n] = str(err)
    return out


def synthetic_vision_tasks(num_tasks: int = 5, n_train: int = 1000, n_test: int = 300, seed: int = 0,
                           noise: Sequence[float] | None = None) -> list[Dataset]:
    """Seeded stand-in tasks (module docstring): ``num_tasks`` x (X_train, y_train, X_test, y_test), 10
    classes each, float32 (N, 3, 32, 32) in [0, 1]. ``noise``: pixel noise std per task (default rising
    from 0.15 to 0.45)."""
    if noise is None:
        noise = [0.15 + 0.3 * t / max(1, num_tasks - 1) for t in range(num_tasks)]
    if len(noise) != num_tasks:
        raise ValueError(f"noise needs one level per task ({num_tasks}), got {len(noise)}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(num_tasks):
        protos = F.interpolate(torch.rand(10, 3, 8, 8, generator=g), size=32, mode="bilinear", align_corners=False)
        parts = []
        for n in (n_train, n_test):
            y = torch.randint(0, 10, (n,), generator=g)
            X = (protos[y] + noise[t] * torch.randn(n, 3, 32, 32, generator=g)).clamp(0, 1)
            parts += [X, y]
        out.append((parts[0], parts[1], parts[2], parts[3]))
    return out
