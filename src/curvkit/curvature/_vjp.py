"""Vector-Jacobian products through autograd without the first-use imports of ``torch.autograd.grad``.

``torch.autograd.grad(outputs, inputs, grad_outputs=V)`` checks the shapes of ``V`` with torch's
symbolic-shape helpers, whose first use in a process imports ``torch.fx.experimental.symbolic_shapes`` and
sympy (about 3 s of a fresh process's first curvature product). :func:`vector_grad` asks instead for the
gradient of the scalar ``sum_i <outputs_i, V_i>``: the same vector-Jacobian product (the product's backward
multiplies V by the incoming gradient 1, exactly), the same graph options, no such import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def vector_grad(outputs: Tensor | Sequence[Tensor], inputs: Tensor | Sequence[Tensor],
                grad_outputs: Tensor | Sequence[Tensor], **kwargs: Any) -> tuple[Tensor, ...]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, **kwargs)`` (not ``is_grads_batched``), as the
    gradient of ``sum_i (outputs_i * grad_outputs_i).sum()``. With ``create_graph`` the result is
    differentiable in ``grad_outputs`` too, as torch's."""
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    vecs = [grad_outputs] if isinstance(grad_outputs, Tensor) else list(grad_outputs)
    if len(outs) != len(vecs):
        raise ValueError(f"vector_grad: {len(outs)} outputs but {len(vecs)} vectors")
    with torch.enable_grad():  # the products join the outputs' graph even where the caller runs without grad
        terms = [(o * v.to(o.dtype)).sum() for o, v in zip(outs, vecs)]
        total = terms[0] if len(terms) == 1 else torch.stack(terms).sum()
    return torch.autograd.grad(total, inputs, **kwargs)
