"""Jacobian-vector products J v of a plain ``nn.Sequential`` from the activations of one recorded forward pass.

For the output f = h_L of a sequence of layers h_l = phi_l(h_{l-1}; theta_l), forward-mode differentiation
in the direction v = (v_1, ..., v_L) propagates a tangent t_l = dh_l alongside the stored activations:

* a layer whose handler is :meth:`~curvkit.layerkinds.LayerHandler.bilinear` (``nn.Linear``, ``nn.Conv1d/2d/3d``:
  h = op(a, W) + b): t_out = op(t_in, W) + op(a, dW) + db, the handler's
  :meth:`~curvkit.layerkinds.LayerHandler.tangent` (``nn.Linear``: t_in W^T + a dW^T + db)
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
:func:`tangent_chain` accepts the model; otherwise they use ``torch.func`` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jvp, vmap

from curvkit.layerkinds import LayerHandler, handler_for
from curvkit.structure import (
    DROPOUTS,
    ELEMENTWISE,
    POOLING,
    RESHAPES,
    ModelStructure,
    curvature_kernels,
    is_random,
    read_model,
)

Params = tuple[Tensor, ...]

_RESHAPES = (*RESHAPES, nn.Identity)


def _bilinear(mod: nn.Module) -> LayerHandler | None:
    """The handler of a module with a tangent rule (:meth:`~curvkit.layerkinds.LayerHandler.bilinear`), else None."""
    handler, _ = handler_for(mod)
    return handler if handler is not None and handler.bilinear(mod) else None


def _attribute(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


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


def tangent_chain(structure: ModelStructure) -> tuple[list[nn.Module] | None, str | None]:
    """(leaf modules in call order, None) for the recorded-tangent route, or (None, reason): a plain (nested)
    ``nn.Sequential`` whose leaves are layers with a tangent rule (their handler is
    :meth:`~curvkit.layerkinds.LayerHandler.bilinear`) and parameter- and buffer-free, deterministic,
    not-in-place modules, each used once (shared parameters allowed)."""
    if type(structure.model) is not nn.Sequential or not structure.is_plain_sequential:
        return None, "not a plain nn.Sequential"
    if structure.reused_modules:
        name, names = next(iter(structure.reused_modules.items()))
        return None, f"module {name or '<root>'!r} is used more than once ({', '.join(names)})"
    chain: list[nn.Module] = []
    for name, mod in structure.leaves:
        label = name or "<root>"
        if _bilinear(mod) is not None:
            chain.append(mod)
            continue
        if any(True for _ in mod.parameters()) or any(True for _ in mod.buffers()):
            return None, f"module {label!r} ({type(mod).__name__}) has parameters or buffers"
        if is_random(mod):
            return None, f"module {label!r} is random in training mode"
        if getattr(mod, "inplace", False):
            return None, f"module {label!r} works in place"
        chain.append(mod)
    return chain, None


def piecewise_linear_reason(structure: ModelStructure) -> str | None:
    """None if the model is VERIFIABLY piecewise linear in each layer's parameters, else why not.

    Verified structurally: a :func:`tangent_chain` model (its layers linear in their input and in their
    parameters separately, :meth:`~curvkit.layerkinds.LayerHandler.bilinear`) whose other modules are
    parameter-free and piecewise linear (the piecewise-linear entries of
    :data:`curvkit.structure.ELEMENTWISE`, reshapes, max/average pooling, Dropout in eval mode), each used
    once and with no parameter shared between layers. Then the output is linear in each layer's (weight, bias)
    with the others fixed (almost everywhere), the output Hessian has zero diagonal blocks, and the loss
    Hessian's diagonal blocks equal the GGN's (thesis Lemma 3.23).
    """
    for pname, owners in structure.shared_parameters.items():
        return (f"parameter {pname!r} is shared by modules {', '.join(repr(o) for o in owners)} (the output "
                "is not linear in a tied weight)")
    chain, reason = tangent_chain(structure)
    if chain is None:
        return reason
    for name, mod in structure.leaves:
        if _bilinear(mod) is not None or ELEMENTWISE.get(type(mod), False):
            continue
        if type(mod) in RESHAPES or type(mod) in POOLING or type(mod) in DROPOUTS:
            continue
        return f"module {name or '<root>'!r} ({type(mod).__name__}) is not known to be piecewise linear"
    return None


def sequential_layers(module: nn.Module) -> list[nn.Module] | None:
    """The leaf modules of a (nested) plain ``nn.Sequential`` in call order, or None if unsupported
    (:func:`tangent_chain` decides)."""
    return tangent_chain(read_model(module))[0]


@dataclass
class _Record:
    module: nn.Module
    inp: Tensor  # (B, ...) detached
    out: Tensor  # (B, ...) detached
    out_graph: Tensor | None  # the output itself when it is on an autograd graph (else None)
    slots: dict[str, int]  # a layer's trainable parameters (attribute path) -> position in the parameter tuple
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
        # layer -> its handler (the tangent rule) and the positions of its trainable parameters in the parameter
        # tuple, read from the module's own parameters now (inside a functional call they are replaced); a
        # parameter shared by two layers has one canonical name, so both layers add their term to the same tangent
        self._rules: dict[int, tuple[LayerHandler, tuple[str, ...]]] = {}
        self._slots: dict[int, dict[str, int]] = {}
        for mod in layers:
            handler = _bilinear(mod)
            if handler is None:
                continue
            paths = handler.owned(mod)
            self._rules[id(mod)] = (handler, paths)
            slots = {}
            for path in paths:
                p = _attribute(mod, path)
                name = structure.canonical_name(p) if isinstance(p, Tensor) else None
                if name is not None and name in index:
                    slots[path] = index[name]
            self._slots[id(mod)] = slots
        self._records: list[_Record] = []
        self._values: dict[int, dict[str, Tensor]] = {}  # id(layer) -> its parameter values of the recorded pass
        self._masks: dict[int, Tensor] = {}

    @classmethod
    def for_model(cls, module: nn.Module, param_names: list[str]) -> SequentialTangent | None:
        structure = read_model(module)
        layers = tangent_chain(structure)[0]
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
        if inputs[0]._version != self._before.pop(id(mod), inputs[0]._version):
            raise RuntimeError(f"layer {self._structure.label(mod)!r} works in place")
        rule = self._rules.get(id(mod))
        if rule is not None:
            # the values this pass used (functional_call swaps them into the module during the call)
            values = {path: _attribute(mod, path) for path in rule[1]}
            self._values[id(mod)] = {path: v.detach() for path, v in values.items() if isinstance(v, Tensor)}
        self._records.append(_Record(mod, inputs[0].detach(), output.detach(),
                                     output if output.requires_grad else None, self._slots.get(id(mod), {}),
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
            rule = self._rules.get(id(mod))
            if rule is not None:
                t = rule[0].tangent(mod, r.inp, t, self._values[id(mod)], {p: V[i] for p, i in r.slots.items()})
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
