"""The precision policy (docs/architecture.md, "Precision"): which dtype curvature is computed and kept in.

A model may run in bfloat16 or float16 (its forward and backward passes, its weights). Curvature
*statistics* are sums over many batches, and factorisations, inverses and log-determinants lose every digit
in 8 bits of mantissa, so curvkit keeps them in float32 or wider:

* ``statistics_dtype`` (every entry point that accumulates or factorises: the estimators, the exact
  operators' diagonals and dense matrices, Laplace, the Gauss-Newton optimiser): ``None`` (default) is
  float32 for a bf16/fp16 model and the model's own dtype otherwise; ``torch.float32`` or ``torch.float64``
  choose it. Each batch's statistic is cast to it before it is added, so the rounding error of a sum does
  not grow with the number of batches.
* ``compute_dtype`` (the estimators, the exact operators, Laplace): ``None`` (default) runs the curvature
  passes in the model's dtype; ``torch.float32``/``torch.float64`` runs them on an upcast copy of the
  parameters, frozen parameters and buffers (and of the floating inputs), so the statistics are those of the
  rounded weights without the passes' own rounding. The copy costs the model's memory again in that dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from curvkit.validation import Inputs, map_inputs

__all__ = ["LOW_PRECISION", "compute_dtype", "model_dtype", "statistics_dtype", "upcast_inputs", "upcast_state"]

LOW_PRECISION = (torch.bfloat16, torch.float16)
_WIDE = (torch.float32, torch.float64)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's trainable parameters (the first one's; float32 for a model without any)."""
    for p in model.parameters():
        if p.requires_grad:
            return p.dtype
    return torch.float32


def statistics_dtype(dtype: torch.dtype, requested: torch.dtype | None = None) -> torch.dtype:
    """The dtype statistics are kept in for a model of ``dtype``: ``requested`` (float32 or float64) or, by
    default, float32 for bf16/fp16 and ``dtype`` itself otherwise (module docstring)."""
    if requested is None:
        return torch.float32 if dtype in LOW_PRECISION else dtype
    if requested not in _WIDE:
        raise ValueError(f"statistics_dtype must be None (float32 for a bf16/fp16 model, else the model's dtype), "
                         f"torch.float32 or torch.float64, got {requested!r}; curvature statistics, "
                         "factorisations and inverses are not kept in less than float32")
    return requested


def compute_dtype(dtype: torch.dtype, requested: torch.dtype | None = None) -> torch.dtype:
    """The dtype of the curvature passes for a model of ``dtype``: its own (None) or ``requested`` (float32 or
    float64: an upcast copy of the model's state; module docstring)."""
    if requested is None:
        return dtype
    if requested not in _WIDE:
        raise ValueError(f"compute_dtype must be None (the model's dtype), torch.float32 or torch.float64, got "
                         f"{requested!r}")
    return requested


def upcast_inputs(X: Inputs, dtype: torch.dtype) -> Inputs:
    """X with every floating tensor of a lower precision than ``dtype`` cast to it (token ids stay)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and torch.finfo(t.dtype).bits < torch.finfo(dtype).bits:
            return t.to(dtype)
        return t
    return map_inputs(cast, X)


def upcast_state(tensors: dict[str, torch.Tensor], dtype: torch.dtype, grad: bool = False) -> dict[str, torch.Tensor]:
    """Detached copies of the floating tensors narrower than ``dtype`` in ``dtype`` (others as they are,
    detached); with ``grad`` the copies of tensors that require grad require grad (autograd leaves)."""
    out = {}
    for n, t in tensors.items():
        c = t.detach()
        if c.is_floating_point() and torch.finfo(c.dtype).bits < torch.finfo(dtype).bits:
            c = c.to(dtype)
        out[n] = c.requires_grad_(grad and t.requires_grad)
    return out
