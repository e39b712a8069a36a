"""Jacobians for the linearised (GLM) predictive, in pieces whose memory is bounded by the batch size.

The GLM predictive variance ``J Sigma J^T`` never needs the full Jacobian of all outputs with respect to
all parameters at once:

* for a Linear/Conv2d layer it needs only the layer's input rows and the Jacobian of the C outputs with
  respect to the layer's OUTPUT (one forward pass with hooks and one batched backward pass over the C
  outputs, :func:`layer_jacobians`): memory ``B * C * out * T`` per layer;
* for any other parameter group (normalisation layers, the ``full`` posterior of a small net) the
  per-sample Jacobian rows of that group only (``torch.func.vmap`` of ``jacrev``,
  :func:`generic_jacobian`): memory ``B * C * d_group``.

B is the batch size the caller chooses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor
from torch.func import jacrev, vmap

from curvkit.curvature.capture import LayerCapture, with_bias_column
from curvkit.laplace._blocks import LayerJacobian
from curvkit.structure import LayerInfo, ModelStructure

__all__ = ["generic_jacobian", "layer_jacobians"]


def layer_jacobians(structure: ModelStructure, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                    layers: Sequence[LayerInfo], X: Tensor) -> tuple[Tensor, dict[str, LayerJacobian]]:
    """Output f (B, C) at ``params`` and, per layer label, its :class:`LayerJacobian`."""
    leaves = {n: t.detach().requires_grad_(True) for n, t in params.items()}
    with LayerCapture(list(layers), "Laplace GLM predictive") as cap, torch.enable_grad():
        f = structure.functional_call(leaves, (X,), buffers)
        if not isinstance(f, Tensor) or f.dim() != 2:
            raise ValueError(f"the model must return (batch, outputs), got "
                             f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__}")
        outs = cap.outputs()
        B, C = f.shape
        eye = torch.eye(C, dtype=f.dtype, device=f.device)[:, None, :].expand(C, B, C)
        try:
            grads = torch.autograd.grad(f, outs, grad_outputs=eye, is_grads_batched=True)
        except RuntimeError:  # an operation without a batching rule: one backward pass per output
            per = [torch.autograd.grad(f, outs, grad_outputs=eye[c], retain_graph=c < C - 1) for c in range(C)]
            grads = tuple(torch.stack([p[i] for p in per]) for i in range(len(outs)))
        out: dict[str, LayerJacobian] = {}
        for rec, g in zip(cap.records, grads):
            g = g.detach()
            if g.dim() == 3:  # Linear: (C, B, out)
                delta = g.transpose(0, 1)[:, :, None, :]
            else:  # Conv2d: (C, B, out, H, W) -> (B, C, T, out)
                delta = g.flatten(3).permute(1, 0, 3, 2)
            T = delta.shape[2]
            assert rec.a is not None
            a = with_bias_column(rec.a, rec.has_bias).reshape(B, T, -1)
            out[rec.info.label] = LayerJacobian(a, delta)
    return f.detach(), out


def generic_jacobian(structure: ModelStructure, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                     names: Sequence[str], X: Tensor) -> Tensor:
    """Per-sample Jacobian rows (B, C, d) of the outputs with respect to the parameters ``names`` (flat,
    in the given order), by ``vmap(jacrev)`` over the batch."""
    sub = {n: params[n].detach() for n in names}
    rest = {n: t.detach() for n, t in params.items() if n not in sub}

    def single(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return structure.functional_call({**rest, **p}, (x.unsqueeze(0),), buffers)[0]  # type: ignore[no-any-return]

    J = vmap(jacrev(single), in_dims=(None, 0))(sub, X)
    B, C = X.shape[0], next(iter(J.values())).shape[1]
    return torch.cat([J[n].reshape(B, C, -1) for n in names], dim=-1)
