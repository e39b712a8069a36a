"""Checks of user input shared by every layer: hyperparameters, tensors, damping.

Each check raises a ``ValueError`` (``TypeError`` for the wrong kind of object) that names the argument,
says what was wrong and what is expected, and returns the validated value, so a constructor reads

    self.lr = positive("lr", lr)

A NaN or an infinity is never a valid hyperparameter unless a check says so (``allow_inf``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "check_damping",
    "finite_tensor",
    "integer",
    "iter_batches",
    "nonnegative",
    "positive",
    "unit_interval",
]


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def positive(name: str, value: Any, *, allow_inf: bool = False) -> float:
    """A finite number > 0 (``inf`` too with ``allow_inf``)."""
    v = _number(name, value)
    if math.isnan(v) or v <= 0 or (math.isinf(v) and not allow_inf):
        extra = " (or inf)" if allow_inf else ""
        raise ValueError(f"{name} must be a finite number > 0{extra}, got {value!r}")
    return v


def nonnegative(name: str, value: Any, *, allow_inf: bool = False) -> float:
    """A finite number >= 0 (``inf`` too with ``allow_inf``)."""
    v = _number(name, value)
    if math.isnan(v) or v < 0 or (math.isinf(v) and not allow_inf):
        extra = " (or inf)" if allow_inf else ""
        raise ValueError(f"{name} must be a finite number >= 0{extra}, got {value!r}")
    return v


def unit_interval(name: str, value: Any, *, closed_left: bool = False, closed_right: bool = False) -> float:
    """A number in (0, 1), with either end closed on request."""
    v = _number(name, value)
    lo_ok = v >= 0 if closed_left else v > 0
    hi_ok = v <= 1 if closed_right else v < 1
    if math.isnan(v) or not (lo_ok and hi_ok):
        interval = f"{'[' if closed_left else '('}0, 1{']' if closed_right else ')'}"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return v


def integer(name: str, value: Any, *, minimum: int = 1) -> int:
    """An integer >= ``minimum`` (bools and non-integral floats are refused)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value)) or int(value) != value):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_damping(damping: Any, name: str = "damping") -> float:
    """A finite damping (a multiple of the identity added to a curvature); NaN and inf are refused."""
    v = _number(name, damping)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {damping!r}")
    return v


def finite_tensor(name: str, t: Tensor) -> Tensor:
    """Raise if ``t`` has a NaN or inf entry (one reduction: a NaN/inf anywhere makes the sum non-finite;
    a finite tensor whose sum overflows is refused too, its entries are beyond any usable value)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() and not bool(torch.isfinite(t.sum())):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} contains NaN or inf ({bad} of {t.numel()} entries)"
                         if bad else f"{name} has entries too large to sum in {t.dtype}")
    return t


def iter_batches(data: Any, device: torch.device | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Validated ``(X, y)`` pairs from a single pair or an iterable of pairs (a list, a generator, a
    ``DataLoader``), one at a time (nothing is materialised).

    A tuple whose first element is a tensor is read as ONE pair; anything else is iterated, and every
    element must be a pair of tensors with the same positive leading (batch) size. Tensors are moved to
    ``device`` (their dtypes are left alone). Raises ValueError for data without any batch.
    """
    if isinstance(data, Tensor):
        raise TypeError("data must be an (X, y) pair of tensors or an iterable of such pairs, got one tensor; "
                        "pass the targets too")
    if isinstance(data, tuple) and len(data) > 0 and isinstance(data[0], Tensor):
        items: Iterable[Any] = [data]
    else:
        try:
            items = iter(data)
        except TypeError:
            raise TypeError(f"data must be an (X, y) pair or an iterable of pairs, got {type(data).__name__}") \
                from None
    count = 0
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2
                and isinstance(item[0], Tensor) and isinstance(item[1], Tensor)):
            raise TypeError(f"batch {i} of data is not an (X, y) pair of tensors (got {type(item).__name__}); "
                            "pass (X, y) or an iterable of (X, y) pairs")
        X, y = item
        if X.dim() == 0 or y.dim() == 0 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
            raise ValueError(f"batch {i}: X and y must share a positive leading batch size, got shapes "
                             f"{tuple(X.shape)} and {tuple(y.shape)}")
        if device is not None:
            X, y = X.to(device), y.to(device)
        count += 1
        yield X, y
    if count == 0:
        raise ValueError("data is empty: pass an (X, y) pair or a non-empty iterable of pairs")


def looks_like_probabilities(f: Tensor) -> bool:
    """Whether outputs ``f`` (B, [*P,] C) are probabilities rather than logits: every entry in [0, 1] and every
    row summing to 1 (within 1e-3), i.e. a softmax already applied. Logits of a real model essentially never
    are; log-probabilities (a final log_softmax) are valid logits and are not flagged."""
    if not (isinstance(f, Tensor) and f.is_floating_point() and f.dim() >= 2 and f.shape[-1] >= 2 and f.numel()):
        return False
    f = f.detach()
    return bool(((f >= 0) & (f <= 1)).all()) and bool(((f.sum(-1) - 1).abs() <= 1e-3).all())
