"""Functional-call machinery shared by the exact curvature operators.

* :func:`as_batches` turns ``data`` (an ``(X, y)`` pair or an iterable of pairs) into a list of pairs.
* :class:`FunctionalModel` snapshots a module's parameters and buffers and evaluates the module as a pure
  function ``f(params, X)`` of a tuple of trainable-parameter tensors (``torch.func.functional_call``),
  which is what ``torch.func.jvp`` / ``vjp`` / ``grad`` / ``vmap`` need.
* :func:`cols_to_params` / :func:`params_to_cols` convert between a (d, k) matrix of flat columns and a
  tuple of parameter tensors with a leading column dimension, (k, *shape) (the layout is
  :class:`curvkit.linalg.layout.ParamLayout`: row-major, ``named_parameters()`` order).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from curvkit.likelihoods import Likelihood
from curvkit.linalg.layout import ParamLayout

Params = tuple[Tensor, ...]
Batch = tuple[Tensor, Tensor]


def as_batches(data: Any, device: torch.device | None = None) -> list[Batch]:
    """A list of ``(X, y)`` pairs from a single pair or an iterable of pairs (materialised once).

    A tuple whose first element is a tensor is read as ONE pair; anything else is iterated, and every
    element must be a pair of tensors with the same leading (batch) size. Tensors are moved to
    ``device`` (their dtypes are left alone).
    """
    if isinstance(data, Tensor):
        raise TypeError("data must be an (X, y) pair of tensors or an iterable of such pairs, got one tensor")
    if isinstance(data, tuple) and len(data) > 0 and isinstance(data[0], Tensor):
        items: list[Any] = [data]
    else:
        try:
            items = list(data)
        except TypeError:
            raise TypeError(f"data must be an (X, y) pair or an iterable of pairs, got {type(data).__name__}") \
                from None
    if not items:
        raise ValueError("data is empty: pass an (X, y) pair or a non-empty iterable of pairs")
    out: list[Batch] = []
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
        out.append((X, y))
    return out


class FunctionalModel:
    """A module evaluated as ``f(params, X)`` at a fixed snapshot of its state.

    At construction the trainable parameters (``requires_grad=True``, in ``named_parameters()`` order,
    which fixes the flat layout) are copied with ``.detach().clone()``, as are the frozen parameters and
    the buffers; later changes to the module (an optimiser step) do not affect the snapshot. The module's
    train/eval mode is NOT frozen: the mode it is in when a product is computed is used (put models with
    dropout in ``eval()``). Per-sample quantities evaluate the module on single-sample batches, so
    modules whose output for one sample depends on the rest of the batch (BatchNorm in training mode)
    are not supported there.
    """

    def __init__(self, module: nn.Module):
        if not isinstance(module, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.layout = ParamLayout.from_module(module)
        named = dict(module.named_parameters())
        self.names = self.layout.names
        self.params: Params = tuple(named[n].detach().clone() for n in self.names)
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"all trainable parameters must share one dtype and device, got dtypes {dtypes} "
                             f"and devices {devices}")
        self.dtype: torch.dtype = self.params[0].dtype
        if not self.dtype.is_floating_point:
            raise ValueError(f"parameters must be floating point, got {self.dtype}")
        self.device: torch.device = self.params[0].device
        trainable = set(self.names)
        self.frozen: dict[str, Tensor] = {n: p.detach().clone() for n, p in module.named_parameters()
                                          if n not in trainable}
        self.frozen.update({n: b.detach().clone() for n, b in module.named_buffers()})

    def __call__(self, params: Params, X: Tensor) -> Tensor:
        state = dict(self.frozen)
        state.update(zip(self.names, params))
        return functional_call(self.module, state, (X,))

    def single(self, params: Params, x: Tensor) -> Tensor:
        """Output for ONE sample ``x`` (no batch dimension), shape (C,)."""
        return self(params, x.unsqueeze(0))[0]


def cols_to_params(layout: ParamLayout, M: Tensor) -> Params:
    """(d, k) -> tuple of (k, *shape) tensors."""
    k = M.shape[1]
    return tuple(M[o:o + n].T.reshape(k, *shape)
                 for o, n, shape in zip(layout.offsets, layout.numels, layout.shapes))


def params_to_cols(tensors: Iterable[Tensor]) -> Tensor:
    """Tuple of (k, *shape) tensors -> (d, k)."""
    parts = [t.reshape(t.shape[0], -1) for t in tensors]
    return torch.cat(parts, dim=1).T


def params_to_rows(tensors: Iterable[Tensor], lead: int) -> Tensor:
    """Tuple of (*lead_dims, *shape) tensors with ``lead`` leading dims -> (*lead_dims, d)."""
    tensors = list(tensors)
    lead_shape = tensors[0].shape[:lead]
    return torch.cat([t.reshape(*lead_shape, -1) for t in tensors], dim=-1)


def checked_output(fmodel: FunctionalModel, likelihood: Likelihood, X: Tensor, y: Tensor | None,
                   batch_index: int) -> Tensor:
    """Model output (B, C) at the snapshot, validated: shape (B, C), finite, targets as the head needs."""
    with torch.no_grad():
        f = fmodel(fmodel.params, X)
    return check_output(f, likelihood, X, y, batch_index)


def check_output(f: Any, likelihood: Likelihood, X: Tensor, y: Tensor | None, batch_index: int) -> Tensor:
    """Validate an already computed model output ``f`` for batch ``X`` (see :func:`checked_output`)."""
    if not isinstance(f, Tensor):
        raise TypeError(f"the model must return one tensor of shape (batch, outputs), got {type(f).__name__}")
    if f.dim() != 2 or f.shape[0] != X.shape[0]:
        raise ValueError(
            f"batch {batch_index}: the model output must have shape (batch, outputs) = ({X.shape[0]}, C), "
            f"got {tuple(f.shape)}; flatten or reshape it inside the model (e.g. end with nn.Flatten())"
        )
    likelihood.check(f.detach(), y)
    return f
