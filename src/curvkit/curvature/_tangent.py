"""Jacobian-vector products J v of a plain ``nn.Sequential`` from the activations of one recorded forward pass.

For the output f = h_L of a sequence of layers h_l = phi_l(h_{l-1}; theta_l), forward-mode differentiation
in the direction v = (v_1, ..., v_L) propagates a tangent t_l = dh_l alongside the stored activations:

* ``nn.Linear``  h = a W^T + b:            t_out = t_in W^T + a dW^T + db
* ``nn.Conv1d/2d`` h = conv(a, W) + b:      t_out = conv(t_in, W) + conv(a, dW) + db
* elementwise activations (ReLU, LeakyReLU, Tanh, Sigmoid, ...): t_out = phi'(a) * t_in, with phi' read
  off the stored output (ReLU: 1[h > 0]; Tanh: 1 - h^2; Sigmoid: h (1 - h))
* reshapes (Flatten, Unflatten, Identity, Dropout in eval mode): t_out = t_in reshaped
* any other parameter-free module (pooling, ...): ``torch.func.jvp`` of the module at its stored input.

Only the tangents are computed (no primal recomputation), for k directions at once: t has shape
(k, B, ...). The a dW^T term of a Linear layer is ONE matrix product a [dW_1; ...; dW_k]^T (and for a
convolution one convolution with the k weight tangents stacked along the output channels), so k
directions cost about two forward passes' worth of matrix products per layer, or one for the first
layer (t_in = 0). This is what a cached linearisation would do, without ``torch.func.linearize``'s
tracing cost. Used by the exact output-factor operators (:mod:`curvkit.curvature.exact`) whenever
:func:`sequential_layers` accepts the model; otherwise they use ``torch.func`` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jvp, vmap

from curvkit.structure import (
    AFFINE,
    DROPOUTS,
    RESHAPES,
    ModelStructure,
    conv_forward,
    curvature_kernels,
    read_model,
)

Params = tuple[Tensor, ...]

_AFFINE = tuple(AFFINE)
_RESHAPES = (*RESHAPES, nn.Identity)


def _derivative(mod: nn.Module) -> Callable[[Tensor, Tensor], Tensor] | None:
    """phi'(input) from (input, output) for the elementwise activations handled without jvp."""
    if type(mod) is nn.ReLU:
        return lambda a, h: (h > 0).to(h.dtype)
    if type(mod) is nn.LeakyReLU:
        slope = float(mod.negative_slope)
        return lambda a, h: (a > 0).to(h.dtype) * (1 - slope) + slope
    if type(mod) is nn.Tanh:
        return lambda a, h: 1 - h * h
    if type(mod) is nn.Sigmoid:
        return lambda a, h: h * (1 - h)
    return None


def sequential_layers(module: nn.Module) -> list[nn.Module] | None:
    """The leaf modules of a (nested) plain ``nn.Sequential`` in call order, or None if unsupported
    (:meth:`curvkit.structure.ModelStructure.tangent_chain` decides)."""
    return read_model(module).tangent_chain()[0]


@dataclass
class _Record:
    module: nn.Module
    inp: Tensor  # (B, ...) detached
    out: Tensor  # (B, ...) detached
    out_graph: Tensor | None  # the output itself when it is on an autograd graph (else None)
    weight: int | None  # index of the weight in the parameter tuple (None: frozen)
    bias: int | None
    versions: tuple[int, int]  # of the input and the output when recorded (an in-place change shows later)

    def changed(self) -> bool:
        return (self.inp._version, self.out._version) != self.versions


class SequentialTangent:
    """Tangent map v -> J v (k directions) for one batch, from the activations recorded by :meth:`record`.

    Build with :meth:`record` around the forward pass whose activations are to be reused; the parameter
    values W used in t_in W^T are those of that pass (``params``; frozen ones from ``frozen``).
    """

    def __init__(self, layers: list[nn.Module], index: dict[str, int], structure: ModelStructure):
        self._layers = layers
        self._index = index  # trainable parameter (canonical) name -> position in the parameter tuple
        self._structure = structure
        # module -> positions of its trainable weight and bias in the parameter tuple, read from the
        # module's own parameters now (inside a functional call they are replaced); a parameter shared by
        # two layers has one canonical name, so both layers add their term to the same tangent
        self._slots: dict[int, tuple[int | None, int | None]] = {}
        for mod in layers:
            if isinstance(mod, _AFFINE):
                weight: Any = mod.weight
                bias: Any = mod.bias
                wn = structure.canonical_name(weight)
                bn = structure.canonical_name(bias) if bias is not None else None
                self._slots[id(mod)] = (index.get(wn) if wn else None, index.get(bn) if bn else None)
        self._records: list[_Record] = []
        self._values: dict[int, Tensor] = {}  # id(module) -> weight value of the recorded pass
        self._masks: dict[int, Tensor] = {}

    @classmethod
    def for_model(cls, module: nn.Module, param_names: list[str]) -> SequentialTangent | None:
        structure = read_model(module)
        layers = structure.tangent_chain()[0]
        if layers is None:
            return None
        return cls(layers, {n: i for i, n in enumerate(param_names)}, structure)

    def record(self, forward: Callable[[], Tensor]) -> Tensor:
        """Run ``forward()`` (which must call the model once) and store every layer's input and output.

        Raises a RuntimeError (the caller then takes the ``torch.func`` route) when a layer works in place:
        it changed its input, or a recorded input or output was changed later in the pass (read from
        PyTorch's version counters, not from an ``inplace`` attribute, so custom modules such
        as ``x.tanh_()`` or ``F.silu(x, inplace=True)`` are seen): the recorded activations would not be the
        layers' own, and a closed-form or ``jvp`` tangent at them would be wrong or would change them."""
        self._records = []
        self._masks = {}
        self._before: dict[int, int] = {}  # id(module) -> version of its input before it ran
        handles = [m.register_forward_hook(self._hook) for m in self._layers]
        handles += [m.register_forward_pre_hook(self._pre_hook) for m in self._layers]
        try:
            out = forward()
        finally:
            for h in handles:
                h.remove()
        if len(self._records) != len(self._layers):
            self._records = []
            raise RuntimeError("the model did not call each of its Sequential layers exactly once")
        if any(r.changed() for r in self._records):
            self._records = []
            raise RuntimeError("a layer of the Sequential works in place")
        return out

    def _pre_hook(self, mod: nn.Module, inputs: tuple[Any, ...]) -> None:
        if inputs and isinstance(inputs[0], Tensor):
            self._before[id(mod)] = inputs[0]._version

    def _hook(self, mod: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if len(inputs) != 1 or not isinstance(inputs[0], Tensor) or not isinstance(output, Tensor):
            raise RuntimeError(f"layer {self._structure.label(mod)!r} does not map one tensor to one tensor")
        w, b = self._slots.get(id(mod), (None, None))
        if inputs[0]._version != self._before.pop(id(mod), inputs[0]._version):
            raise RuntimeError(f"layer {self._structure.label(mod)!r} works in place")
        if isinstance(mod, _AFFINE):
            # the values this pass used (functional_call swaps them into the module during the call)
            self._values[id(mod)] = mod.weight.detach()  # type: ignore[operator]
        self._records.append(_Record(mod, inputs[0].detach(), output.detach(),
                                     output if output.requires_grad else None, w, b,
                                     (inputs[0]._version, output._version)))

    def layer_io(self, module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
        """(input detached, output on the graph or None) recorded for ``module``, or None if not recorded."""
        for r in self._records:
            if r.module is module:
                return r.inp, r.out_graph
        return None

    def __call__(self, V: Params) -> Tensor:
        """J v for every direction: V = tuple of (k, *shape) parameter tensors -> (k, B, C). Modules without a
        closed form run inside :func:`curvkit.structure.curvature_kernels` (forward-mode derivatives)."""
        with curvature_kernels():
            return self._propagate(V)

    def _propagate(self, V: Params) -> Tensor:
        k = V[0].shape[0]
        t: Tensor | None = None
        for i, r in enumerate(self._records):
            mod = r.module
            if isinstance(mod, _AFFINE):
                t = self._affine(r, t, V, k)
            elif t is None:
                continue
            elif type(mod) in _RESHAPES or isinstance(mod, DROPOUTS):
                t = t.reshape(k, *r.out.shape)
            else:
                deriv = _derivative(mod)
                if deriv is not None:
                    mask = self._masks.get(i)
                    if mask is None:
                        mask = self._masks[i] = deriv(r.inp, r.out)
                    t = t * mask
                else:
                    t = vmap(lambda tt, mod=mod, a=r.inp: jvp(mod, (a,), (tt,))[1])(t)
        out = self._records[-1].out
        return torch.zeros(k, *out.shape, dtype=out.dtype, device=out.device) if t is None else t

    def _affine(self, r: _Record, t: Tensor | None, V: Params, k: int) -> Tensor | None:
        mod, a = r.module, r.inp
        W = self._values[id(mod)]
        dW = V[r.weight] if r.weight is not None else None
        db = V[r.bias] if r.bias is not None else None
        out: Tensor | None = None
        if isinstance(mod, nn.Linear):
            if t is not None:
                out = t @ W.T
            if dW is not None:  # a dW_j^T for every direction j: a batched matrix product, (k, B, ..., out)
                term = torch.matmul(a, dW.mT) if a.dim() == 2 else torch.einsum("b...i,koi->kb...o", a, dW)
                out = term if out is None else out.add_(term)
            if db is not None:
                term = db.view(k, *([1] * (a.dim() - 1)), -1)
                out = term.expand(k, *a.shape[:-1], db.shape[-1]) if out is None else out + term
            return out
        def conv(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            return conv_forward(mod, x, w, b)

        if t is not None:
            out = conv(t.flatten(0, 1), W, None)
            out = out.view(k, -1, *out.shape[1:])
        if dW is not None or db is not None:
            o = W.shape[0]
            if dW is None:
                dW = torch.zeros(k, *W.shape, dtype=W.dtype, device=W.device)
            if mod.groups == 1:  # the k weight tangents stacked along the output channels: one convolution
                term = conv(a, dW.reshape(k * o, *W.shape[1:]), None if db is None else db.reshape(k * o))
                term = term.view(a.shape[0], k, o, *term.shape[2:]).transpose(0, 1)
            else:
                term = torch.stack([conv(a, dW[j], None if db is None else db[j]) for j in range(k)])
            out = term if out is None else out + term
        return out
