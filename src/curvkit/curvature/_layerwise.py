"""Fast exact diagonal of J^T S S^T J for models whose parameters all live in layers with a squared-gradient rule.

For a layer with per-sample input a_n and the back-propagated output-factor columns
delta_{n,r} = d(s_{n,r}^T f_n) / d h_n (h = the layer's output, s_{n,r} = column r of S_n), the
per-sample gradient is delta_{n,r} a_n^T (Linear) or sum_p delta_{n,r,p} unfold(a_n)_p^T (convolution), so

    diag = sum_{n,r} (delta_{n,r} a_n^T)^2 = sum_{n,r} (delta_{n,r}^2) (a_n^2)^T            (Linear)

needs R batched backward passes to the layer outputs (``autograd.grad(..., is_grads_batched=True)``)
instead of N * R per-sample gradients of the full parameter vector. The deltas come from zero tensors
added to each layer's output by forward hooks, so only the layer outputs are differentiated. The squares of
each layer are its handler's (:meth:`curvkit.layerkinds.LayerHandler.squared_gradients`).

Used only when it is exact: every trainable parameter is the weight or bias of a layer whose handler has the
rule (:meth:`curvkit.layerkinds.LayerHandler.squares`: ``nn.Linear`` on (B, in) inputs, ``nn.Conv1d/2d/3d`` with
groups 1, any padding mode), no parameter is shared, each such module runs once per forward pass, and the
model treats samples independently (no batch statistics). :func:`layer_specs` returns None when the parameter
set is not covered; :class:`Unsupported` is raised at run time for the other conditions (a Linear layer's
input with positions among them), and the caller then falls back to generic per-sample gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from curvkit.curvature._functional import FunctionalModel
from curvkit.layerkinds import LayerHandler, handler_for
from curvkit.validation import Inputs


class Unsupported(Exception):
    """The layer-wise fast path does not apply to this model / input."""


@dataclass
class LayerSpec:
    module: nn.Module
    handler: LayerHandler  # its squared-gradient rule
    weight: str  # parameter name in the layout
    bias: str | None


def layer_specs(fmodel: FunctionalModel) -> list[LayerSpec] | None:
    """The layers owning ALL trainable parameters, each with a handler that has the squared-gradient rule
    (:meth:`~curvkit.layerkinds.LayerHandler.squares`) and a trainable weight; None when the route does not
    apply (shared parameters, reused modules, batch statistics, random modules, another layer)."""
    structure = fmodel.structure
    if structure.shared_parameters or structure.reused_modules or structure.mixing or structure.random:
        return None
    out: list[LayerSpec] = []
    covered: set[str] = set()
    for lay in structure.layers:
        handler, _ = handler_for(lay.module)
        if handler is None or not handler.squares(lay.module) or lay.weight is None:
            return None
        out.append(LayerSpec(lay.module, handler, lay.weight, lay.bias))
        covered.update(lay.params)
    return out if covered == set(structure.trainable) else None


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
            if not specs[i].handler.squares(mod, a):
                raise Unsupported(f"layer {type(mod).__name__} got an input of shape {tuple(a.shape)} that its "
                                  "squared-gradient rule does not take (a Linear layer on positions)")
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
    for i, spec in enumerate(specs):  # deltas[i]: (R, B, *out_shape)
        squares = spec.handler.squared_gradients(spec.module, inputs[i], deltas[i])
        out[spec.weight] = squares["weight"]
        if spec.bias is not None:
            out[spec.bias] = squares["bias"]
    return out
