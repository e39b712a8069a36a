"""Checks of user input shared by every layer: hyperparameters, tensors, damping, data.

Each check raises a ``ValueError`` (``TypeError`` for the wrong kind of object) that names the argument,
says what was wrong and what is expected, and returns the validated value, so a constructor reads

    self.lr = positive("lr", lr)

A NaN or an infinity is never a valid hyperparameter unless a check says so (``allow_inf``).

Model inputs. A batch of model inputs ``X`` is a tensor (B, ...) or a MAPPING of tensors that all share the
leading batch dimension B (``{"input_ids": (B, T), "attention_mask": (B, T)}``, a Hugging Face
``BatchEncoding``). The model is always called with the batch as ONE positional argument, ``model(X)``,
whatever its kind (a module whose forward takes keyword tensors is wrapped, e.g. by
:class:`curvkit.hf.HuggingFace`, which calls ``model(**X)``). The curvature engine never indexes, sizes or
moves a batch itself: it goes through the helpers below (:func:`check_inputs`, :func:`num_samples`,
:func:`take_samples`, :func:`split_samples`, :func:`inputs_to`, :func:`map_inputs`, :func:`input_tensors`,
:func:`describe_inputs`),
which treat a tensor and every tensor of a mapping alike (a mapping is read into a plain ``dict`` in its
key order, so ``torch.func.vmap`` and ``functional_call`` see a pytree). :func:`iter_batches` reads mapping
batches for the readers that take them (``mappings=True``) and refuses them by name elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeAlias, overload

import torch
from torch import Tensor

__all__ = [
    "Inputs",
    "check_damping",
    "check_inputs",
    "describe_inputs",
    "finite_tensor",
    "first_nonfinite",
    "input_tensors",
    "inputs_to",
    "integer",
    "iter_batches",
    "map_inputs",
    "nonnegative",
    "num_samples",
    "positive",
    "split_samples",
    "take_samples",
    "unit_interval",
]

#: A batch of model inputs: a tensor (B, ...) or a mapping of tensors sharing the leading dimension B.
Inputs: TypeAlias = Tensor | dict[str, Tensor]


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


def first_nonfinite(tensors: Sequence[Tensor]) -> int | None:
    """The position of the first tensor with a NaN or inf entry, None if every entry is finite: ONE read of the
    device for all of them, one pass over each (its sum, which a NaN or inf entry makes non-finite; a check per
    tensor would stall a GPU's queue once per tensor, and ``isfinite(t).all()`` is five passes). Only when a
    sum is not finite are the entries themselves checked (a sum can overflow where no entry is infinite)."""
    if not tensors:
        return None
    device = tensors[0].device
    sums = torch.stack([t.sum().to(device, torch.float64 if t.dtype == torch.float64 else torch.float32)
                        for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return None
    return next((i for i, t in enumerate(tensors) if not bool(torch.isfinite(t).all())), None)


def storage_key(t: Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same data: their memory (address, shape, strides, dtype, device) and its
    version counter (unchanged in place since; a view shares its base's counter). Two views of one tensor (each
    module hook's own ``detach()``, a dual tensor's primal and the parameter) have the same key. Compare keys only
    while the first tensor is held, so that its memory cannot have become another tensor's."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)


def describe_inputs(X: Any) -> str:
    """A short description for error messages: a tensor's shape, a mapping's key -> shape."""
    if isinstance(X, Tensor):
        return str(tuple(X.shape))
    if isinstance(X, Mapping):
        return "{" + ", ".join(f"{k!r}: {tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__}"
                               for k, v in X.items()) + "}"
    return type(X).__name__


def check_inputs(X: Any, name: str = "X") -> Inputs:
    """A validated batch of model inputs (module docstring): a tensor with a leading batch dimension of
    positive size, or a non-empty mapping of such tensors with string keys and one common batch size,
    returned as a plain ``dict`` (key order kept; the tensors are not copied)."""
    if isinstance(X, Tensor):
        if X.dim() == 0 or X.shape[0] == 0:
            raise ValueError(f"{name} must have a positive leading batch size (samples first), got shape "
                             f"{tuple(X.shape)}")
        return X
    if not isinstance(X, Mapping):
        raise TypeError(f"{name} must be a tensor (batch, ...) or a mapping of such tensors (e.g. "
                        f"{{'input_ids': ..., 'attention_mask': ...}}), got {type(X).__name__}")
    if not X:
        raise ValueError(f"{name} is an empty mapping; it must hold the model's input tensors")
    bad = [k for k, v in X.items() if not isinstance(k, str) or not isinstance(v, Tensor) or v.dim() == 0]
    if bad:
        raise TypeError(f"{name}: every entry of an input mapping must be a tensor with a batch dimension under a "
                        f"string key, but {bad[0]!r} is not ({describe_inputs(X)}); pass non-tensor options "
                        "to the model (or its adapter) instead")
    sizes = {int(v.shape[0]) for v in X.values()}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"{name}: the tensors of an input mapping must share one positive leading batch size, "
                         f"got {describe_inputs(X)}")
    return dict(X)


def num_samples(X: Inputs) -> int:
    """The batch size B of a (checked) input batch: the leading size of the tensor or of the mapping's."""
    if isinstance(X, Tensor):
        return int(X.shape[0])
    return int(next(iter(X.values())).shape[0])


def map_inputs(fn: Callable[[Tensor], Tensor], X: Inputs) -> Inputs:
    """``fn`` applied to the tensor, or to every tensor of the mapping (same keys)."""
    if isinstance(X, Tensor):
        return fn(X)
    return {k: fn(v) for k, v in X.items()}


def ordinary(t: Tensor) -> Tensor:
    """``t``, or a copy of it outside ``torch.inference_mode`` if it is an inference tensor (one created inside
    that mode): autograd refuses to save inference tensors for a backward pass, so curvkit's curvature passes
    take every input, target and vector through this (:func:`curvkit.structure.differentiable`)."""
    if not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


def input_tensors(X: Inputs, name: str = "X") -> list[tuple[str, Tensor]]:
    """(label, tensor) for each tensor of an input batch, for checks that name what they refuse: ``[(name,
    X)]`` for a tensor, ``[(f"{name}[{key!r}]", X[key]), ...]`` for a mapping."""
    if isinstance(X, Tensor):
        return [(name, X)]
    return [(f"{name}[{k!r}]", v) for k, v in X.items()]


def take_samples(X: Inputs, index: Any) -> Inputs:
    """The samples ``index`` (a slice, an integer tensor or list of rows) of an input batch: ``X[index]``
    for a tensor, the same rows of every tensor of a mapping."""
    return map_inputs(lambda t: t[index], X)


def split_samples(X: Inputs, pieces: int) -> list[Inputs]:
    """The batch in ``pieces`` consecutive parts along the samples (``Tensor.tensor_split``: sizes differ by
    at most one)."""
    if isinstance(X, Tensor):
        return list(X.tensor_split(pieces))
    parts = {k: v.tensor_split(pieces) for k, v in X.items()}
    return [{k: parts[k][i] for k in X} for i in range(pieces)]


def inputs_to(X: Inputs, device: torch.device | str | None) -> Inputs:
    """The batch on ``device`` (dtypes left alone); unchanged for ``None``."""
    if device is None:
        return X
    return map_inputs(lambda t: t.to(device), X)


@overload
def iter_batches(data: Any, device: torch.device | None = None, *,
                 mappings: Literal[False] = False) -> Iterator[tuple[Tensor, Tensor]]: ...


@overload
def iter_batches(data: Any, device: torch.device | None = None, *,
                 mappings: Literal[True]) -> Iterator[tuple[Inputs, Tensor]]: ...


def iter_batches(data: Any, device: torch.device | None = None, *,
                 mappings: bool = False) -> Iterator[tuple[Inputs, Tensor]]:
    """Validated ``(X, y)`` pairs from a single pair or an iterable of pairs (a list, a generator, a
    ``DataLoader``), one at a time (nothing is materialised).

    ``X`` is a batch of model inputs: a tensor, or with ``mappings`` (for the readers that take them: the
    exact operators and the estimators) also a mapping of tensors such as ``{"input_ids": ...,
    "attention_mask": ...}`` (module docstring; read into a plain dict); ``y`` the targets. A tuple whose
    first element is a tensor or a mapping is read as ONE pair; anything else is iterated, and every element
    must be such a pair with one positive leading (batch) size. Tensors are moved to ``device`` (their dtypes
    are left alone); tensors created inside ``torch.inference_mode`` are copied out of it (:func:`ordinary`). Raises ValueError for data without any batch, and a TypeError naming the reader's limit
    for a mapping batch without ``mappings``.
    """
    if isinstance(data, Tensor):
        raise TypeError("data must be an (X, y) pair of tensors or an iterable of such pairs, got one tensor; "
                        "pass the targets too")
    if isinstance(data, Mapping):
        raise TypeError(f"data must be an (X, y) pair or an iterable of pairs, got one mapping "
                        f"({describe_inputs(data)}); pass the model inputs and the targets as a pair, e.g. "
                        "(batch, batch.pop('labels'))")
    if isinstance(data, tuple) and len(data) > 0 and isinstance(data[0], (Tensor, Mapping)):
        items: Iterable[Any] = [data]
    else:
        try:
            items = iter(data)
        except TypeError:
            raise TypeError(f"data must be an (X, y) pair or an iterable of pairs, got {type(data).__name__}") \
                from None
    count = 0
    for i, item in enumerate(items):
        if isinstance(item, Mapping):
            raise TypeError(f"batch {i} of data is not an (X, y) pair but a mapping ({describe_inputs(item)}); pass "
                            "the model inputs and the targets as a pair, e.g. (batch, batch.pop('labels'))")
        if not (isinstance(item, (tuple, list)) and len(item) == 2
                and isinstance(item[0], (Tensor, Mapping)) and isinstance(item[1], Tensor)):
            raise TypeError(f"batch {i} of data is not an (X, y) pair of tensors (got {type(item).__name__}); "
                            "pass (X, y) or an iterable of (X, y) pairs (X a tensor or a mapping of tensors)")
        if isinstance(item[0], Mapping) and not mappings:
            raise TypeError(f"batch {i}: X is a mapping of tensors ({describe_inputs(item[0])}), which this reader "
                            "does not take yet (the exact operators, the estimators, GaussNewton and Laplace do); "
                            "pass a tensor X")
        X, y = check_inputs(item[0], f"batch {i}: X"), item[1]
        if y.dim() == 0 or num_samples(X) != y.shape[0]:
            raise ValueError(f"batch {i}: X and y must share a positive leading batch size, got "
                             f"{describe_inputs(X)} and {tuple(y.shape)}")
        if device is not None:
            X, y = inputs_to(X, device), y.to(device)
        X, y = map_inputs(ordinary, X), ordinary(y)
        count += 1
        yield X, y
    if count == 0:
        raise ValueError("data is empty: pass an (X, y) pair or a non-empty iterable of pairs")
