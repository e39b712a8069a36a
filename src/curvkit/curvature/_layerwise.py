"""Fast exact diagonal of J^T S S^T J for models whose parameters all live in Linear / Conv2d layers.

For such a layer with per-sample input a_n and the back-propagated output-factor columns
delta_{n,r} = d(s_{n,r}^T f_n) / d h_n (h = the layer's output, s_{n,r} = column r of S_n), the
per-sample gradient is delta_{n,r} a_n^T (Linear) or sum_p delta_{n,r,p} unfold(a_n)_p^T (Conv2d), so

    diag = sum_{n,r} (delta_{n,r} a_n^T)^2 = sum_{n,r} (delta_{n,r}^2) (a_n^2)^T            (Linear)

needs R batched backward passes to the layer outputs (``autograd.grad(..., is_grads_batched=True)``)
instead of N * R per-sample gradients of the full parameter vector. The deltas come from zero tensors
added to each layer's output by forward hooks, so only the layer outputs are differentiated.

Used only when it is exact: every trainable parameter is the weight or bias of an ``nn.Linear`` (2-D
input) or an ``nn.Conv2d`` (groups = 1, any padding mode), no parameter is shared, each such module runs
once per forward pass, and the model treats samples independently (no batch statistics). :func:`layer_specs` returns None when the
parameter set is not covered; :class:`Unsupported` is raised at run time for the other conditions, and
the caller then falls back to generic per-sample gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from curvkit.curvature._functional import FunctionalModel
from curvkit.structure import conv_patches
from curvkit.validation import Inputs

_BUDGET = 2**24  # scalars per chunk of per-sample Conv2d gradients


class Unsupported(Exception):
    """The layer-wise fast path does not apply to this model / input."""


@dataclass
class LayerSpec:
    module: nn.Module
    weight: str  # parameter name in the layout
    bias: str | None


def layer_specs(fmodel: FunctionalModel) -> list[LayerSpec] | None:
    """Linear / Conv2d layers owning ALL trainable parameters (none shared, no batch statistics), or None
    (:meth:`curvkit.structure.ModelStructure.layerwise_layers` decides)."""
    layers = fmodel.structure.layerwise_layers()
    if layers is None:
        return None
    return [LayerSpec(lay.module, lay.weight, lay.bias) for lay in layers]  # type: ignore[arg-type]


def layerwise_diagonal(fmodel: FunctionalModel, specs: list[LayerSpec], X: Inputs,
                       S: Tensor | Callable[[Tensor], Iterable[Tensor]]) -> dict[str, Tensor]:
    """sum_{n,r} (per-sample gradient of s_{n,r}^T f_n)^2 per parameter name; S is (B, C, R).

    ``S`` may also be a function of the (detached) model output f (B, C) returning S in chunks of columns
    (B, C, r): it is then evaluated on the output of the hooked forward pass itself (no separate forward
    pass for S), and each chunk costs r batched backward passes. Outputs with positions (B, *P, C) are
    :class:`Unsupported` (a column would mix the positions of a sample).
    """
    inputs: dict[int, Tensor] = {}
    eps: dict[int, Tensor] = {}
    versions: dict[int, int] = {}

    def hook(i: int):  # type: ignore[no-untyped-def]
        def fn(mod: nn.Module, inp: tuple[Tensor, ...], out: Tensor) -> Tensor:
            if i in inputs:
                raise Unsupported("a layer runs more than once per forward pass")
            a = inp[0]
            if isinstance(mod, nn.Linear) and a.dim() != 2:
                raise Unsupported("Linear layer with an input of more than 2 dimensions")
            inputs[i] = a.detach()
            versions[i] = a._version
            e = torch.zeros_like(out, requires_grad=True)
            eps[i] = e
            return out + e
        return fn

    handles = [spec.module.register_forward_hook(hook(i)) for i, spec in enumerate(specs)]
    try:
        with torch.enable_grad():
            f = fmodel(fmodel.params, X)
    finally:
        for h in handles:
            h.remove()
    if len(eps) != len(specs):
        raise Unsupported("a layer was not run in the forward pass")
    if any(inputs[i]._version != v for i, v in versions.items()):
        raise Unsupported("a layer's input was changed in place later in the forward pass")
    if f.dim() != 2:
        raise Unsupported("outputs with positions")
    chunks = S(f.detach()) if callable(S) else [S]
    acts, outs = [inputs[i] for i in range(len(specs))], [eps[i] for i in range(len(specs))]
    total: dict[str, Tensor] = {}
    for chunk in chunks:
        for name, val in squared_gradients(specs, acts, f, outs, chunk, retain_graph=True).items():
            total[name] = total[name] + val if name in total else val
    return total


def squared_gradients(specs: list[LayerSpec], inputs: list[Tensor], f: Tensor, outputs: list[Tensor], S: Tensor,
                      retain_graph: bool = False) -> dict[str, Tensor]:
    """The diagonal from a recorded forward pass: ``inputs[i]`` (detached) and ``outputs[i]`` (on f's graph)
    of layer ``specs[i]``, the model output f (B, C) and S (B, C, R); one batched backward pass to the
    layer outputs (``retain_graph`` keeps f's graph for later use)."""
    U = S.permute(2, 0, 1).contiguous()  # (R, B, C)
    deltas = torch.autograd.grad(f, outputs, grad_outputs=U, is_grads_batched=True, allow_unused=True,
                                 materialize_grads=True, retain_graph=retain_graph)
    out: dict[str, Tensor] = {}
    for i, spec in enumerate(specs):
        a, d = inputs[i], deltas[i]  # d: (R, B, *out_shape)
        mod = spec.module
        if isinstance(mod, nn.Linear):  # sum_r d_rbo^2 first: (B, out), then one (out, B) x (B, in) product
            q = d.square().sum(0)  # not in place: autograd may hand the same gradient tensor to two layers
            out[spec.weight] = q.T @ a**2
            if spec.bias is not None:
                out[spec.bias] = q.sum(0)
        else:
            assert isinstance(mod, nn.Conv2d)
            cols = conv_patches(mod, a).transpose(1, 2)  # (B, K, P), any padding mode
            d = d.reshape(d.shape[0], d.shape[1], d.shape[2], -1)  # (R, B, O, P)
            acc = torch.zeros(d.shape[2], cols.shape[1], dtype=d.dtype, device=d.device)
            step = max(1, _BUDGET // (d.shape[1] * d.shape[2] * cols.shape[1]))
            for r in range(0, d.shape[0], step):  # per-sample gradients (r, B, O, K), in chunks
                acc += (torch.einsum("rbop,bkp->rbok", d[r:r + step], cols) ** 2).sum((0, 1))
            out[spec.weight] = acc.reshape(mod.weight.shape)
            if spec.bias is not None:
                out[spec.bias] = (d.sum(-1) ** 2).sum((0, 1))
    return out
