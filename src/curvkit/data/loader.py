"""Mini-batches over in-memory tensors, without ``Dataset``/``DataLoader`` machinery.

>>> X, y = torch.arange(10).reshape(5, 2), torch.arange(5)
>>> [yb.tolist() for _, yb in iterate_batches(X, y, 2, shuffle=False)]
[[0, 1], [2, 3], [4]]
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["iterate_batches", "num_batches", "train_test_split"]


def _check_pair(name: str, X: Tensor, y: Tensor) -> int:
    if not isinstance(X, Tensor) or not isinstance(y, Tensor):
        raise TypeError(f"{name}: X and y must be torch.Tensors, got {type(X).__name__} and {type(y).__name__}")
    if X.ndim < 1 or y.ndim < 1 or X.shape[0] != y.shape[0]:
        raise ValueError(
            f"{name}: X and y must have the same first (data) dim, got shapes {tuple(X.shape)} and {tuple(y.shape)}"
        )
    return X.shape[0]


def _check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return batch_size


def num_batches(n: int, batch_size: int, drop_last: bool = False) -> int:
    """How many batches :func:`iterate_batches` yields for ``n`` data points."""
    batch_size = _check_batch_size(batch_size)
    return n // batch_size if drop_last else -(-n // batch_size)


def iterate_batches(
    X: Tensor,
    y: Tensor,
    batch_size: int,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(X[idx], y[idx])`` for consecutive chunks ``idx`` of ``batch_size`` indices.

    With ``shuffle`` the order is ``torch.randperm(N, generator=generator)``, drawn once when iteration
    starts (``generator=None`` uses the global torch RNG; pass a seeded generator for reproducible epochs).
    Without ``shuffle`` batches are contiguous views. The last batch is smaller unless ``drop_last``.
    Every point appears exactly once per pass (except the dropped remainder).
    """
    N = _check_pair("iterate_batches", X, y)
    batch_size = _check_batch_size(batch_size)
    stop = (N // batch_size) * batch_size if drop_last else N
    if not shuffle:
        for start in range(0, stop, batch_size):
            yield X[start : start + batch_size], y[start : start + batch_size]
        return
    order = torch.randperm(N, generator=generator)
    for start in range(0, stop, batch_size):
        idx = order[start : start + batch_size]
        yield X[idx.to(X.device)], y[idx.to(y.device)]


def train_test_split(
    X: Tensor, y: Tensor, test_fraction: float = 0.2, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random split ``(X_train, y_train, X_test, y_test)`` with ``round(test_fraction * N)`` test points.

    The permutation comes from a private generator seeded with ``seed`` (global RNG untouched).
    """
    N = _check_pair("train_test_split", X, y)
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"train_test_split: test_fraction must lie in (0, 1), got {test_fraction!r}")
    n_test = round(float(test_fraction) * N)
    if n_test < 1 or n_test >= N:
        raise ValueError(
            f"train_test_split: test_fraction={test_fraction} of N={N} gives {n_test} test points; "
            "need at least one point in each part"
        )
    order = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
    test, train = order[:n_test], order[n_test:]
    return X[train], y[train], X[test], y[test]
