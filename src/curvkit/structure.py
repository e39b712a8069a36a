"""One reader of a model's structure, asked by every fast path and every structured approximation.

``read_model(model)`` reads an ``nn.Module`` once and answers, with one vocabulary and one wording of
errors, what the rest of curvkit needs to know before it takes a cheaper route or builds a structured
approximation:

* its **layers** (modules that own trainable parameters) with their trainable parameters; it does not
  classify them: what a layer computes, and which routes may take it, is known only to its handler in
  :mod:`curvkit.layerkinds` (the Kronecker blocks, and the capabilities the other routes query: a tangent rule,
  squared per-sample gradients, paired rows);
* its **parameters** under their canonical names (the first name ``named_parameters()`` gives, which
  is the name every :class:`~curvkit.linalg.layout.ParamLayout` uses), with **shared parameters**
  (one tensor owned by two modules: weight tying) and **reused modules** (one module registered under
  two names, so it is called twice) detected;
* its **activations** (elementwise modules from :data:`ELEMENTWISE`) and whether it is a plain
  ``nn.Sequential`` chain;
* modules that **mix samples** (BatchNorm using batch statistics) or are **random** (Dropout with
  p > 0 and RReLU in training mode), and activations that work **in place**.

The routes' predicates (the support table of ``docs/architecture.md``) combine these facts with the layer
kinds' capabilities and live with the routes (:func:`curvkit.curvature._tangent.tangent_chain`,
:func:`curvkit.curvature._layerwise.layer_specs`, :func:`curvkit.layerkinds.plan`); the one predicate left
here, :meth:`ModelStructure.mlp_chain` (``nn.Sequential`` [Flatten] Linear (act...) Linear ... Linear with
activations from :data:`ELEMENTWISE`, all parameters trainable), reads the fixed chain of thesis Eq. 3.10
(exactly ``nn.Linear`` layers: the recursions' algebra is written for them).

Every refusal is an :class:`UnsupportedModelError` (a ``ValueError``) worded
``"{what}: module 'name' (Type) {why}; {how to fix}"``.

:meth:`ModelStructure.functional_call` evaluates the model at given parameter values without touching
the user's module: ``torch.func.functional_call`` with tied weights replaces a parameter of a module
registered under two names by a plain tensor and never restores it; this reader passes one entry per
distinct (module, attribute) slot and checks afterwards that every parameter object is back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call as _torch_functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "ELEMENTWISE",
    "LayerInfo",
    "MLPChain",
    "ModelStructure",
    "UnsupportedModelError",
    "couples_samples",
    "curvature_kernels",
    "kept_running_statistics",
    "read_model",
    "running_statistics",
]

# Elementwise activations (output i depends on input i only), with whether each is piecewise linear.
ELEMENTWISE: dict[type[nn.Module], bool] = {
    nn.ReLU: True, nn.LeakyReLU: True, nn.ReLU6: True, nn.Hardtanh: True, nn.Hardsigmoid: True,
    nn.Hardshrink: True, nn.Softshrink: True, nn.Identity: True,
    nn.Tanh: False, nn.Sigmoid: False, nn.GELU: False, nn.SiLU: False, nn.ELU: False, nn.CELU: False,
    nn.SELU: False, nn.Softplus: False, nn.Mish: False, nn.Softsign: False, nn.Hardswish: False,
    nn.LogSigmoid: False, nn.Tanhshrink: False,
}
RESHAPES: tuple[type[nn.Module], ...] = (nn.Flatten, nn.Unflatten)
# Parameter-free, per-sample, piecewise-linear modules other than activations.
POOLING: tuple[type[nn.Module], ...] = (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
                                        nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d,
                                        nn.AdaptiveMaxPool2d)
DROPOUTS: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                                         nn.AlphaDropout, nn.FeatureAlphaDropout)


@contextmanager
def curvature_kernels() -> Iterator[None]:
    """Run a model with kernels that have every derivative curvature needs, and restore the user's settings.

    PyTorch's fused attention (the flash/efficient ``scaled_dot_product_attention`` kernels on CPU and CUDA)
    has no forward-mode derivative and no double backward, and the eval-mode fast path of
    ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` runs one fused kernel that also skips any
    Python-level change to the layer's submodules (a LoRA adapter on ``linear1`` is silently ignored). Inside
    this context the math attention backend is the only one enabled and the fast path is off, so the model
    computes exactly the function its modules describe, with every derivative; activation checkpointing is
    bypassed (:func:`without_checkpointing`). The previous backend
    selection and fast-path flag are restored on exit (also on error). Every model evaluation of the
    curvature engine (:meth:`ModelStructure.functional_call` and the estimators' forward passes) runs in it.
    """
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH), without_checkpointing():
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


class _CallDirectly:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` (the reentrant variant): runs the function."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        return function(*args)


def _no_recomputation(*_: Any, **__: Any) -> Iterator[None]:
    """Stands in for the non-reentrant variant's set-up (saved-tensor hooks): none; ``checkpoint`` then runs the
    function once between the generator's two steps."""
    yield


_CHECKPOINT_PATCH = {"CheckpointFunction": _CallDirectly, "_checkpoint_without_reentrant_generator": _no_recomputation}
_bypass_depth = [0]


def checkpointing_bypassed() -> bool:
    """Whether a curvature pass is running (:func:`without_checkpointing`)."""
    return _bypass_depth[0] > 0


@contextmanager
def without_checkpointing() -> Iterator[None]:
    """Run every ``torch.utils.checkpoint.checkpoint`` call (both variants, also through ``checkpoint_sequential``
    and Hugging Face's ``gradient_checkpointing_enable``) as a plain call of its function, and restore torch on
    exit; entered by :func:`curvature_kernels`, so by every curvature pass.

    Activation checkpointing recomputes a segment's forward pass in the backward pass: the reentrant variant
    runs the segment without autograd (layer hooks see no graph, and ``torch.autograd.grad`` is refused), and
    both variants meet ``torch.func`` transforms and double backward badly. A checkpointed segment computes the
    same function, so the curvature passes run it directly: the numbers are those of the model without
    checkpointing, at the memory of a pass without it. Checkpointing has no switch in torch, so this replaces
    ``torch.utils.checkpoint.CheckpointFunction`` and ``_checkpoint_without_reentrant_generator`` (read by
    ``checkpoint`` at each call) for the duration of the context, process-wide (another thread's checkpointed
    pass in that time runs without recomputation too: the same numbers, more memory).
    """
    import torch.utils.checkpoint as cp

    first = _bypass_depth[0] == 0
    saved = {name: getattr(cp, name) for name in _CHECKPOINT_PATCH if hasattr(cp, name)} if first else {}
    for name in saved:
        setattr(cp, name, _CHECKPOINT_PATCH[name])
    _bypass_depth[0] += 1
    try:
        yield
    finally:
        _bypass_depth[0] -= 1
        for name, value in saved.items():
            setattr(cp, name, value)


@contextmanager
def differentiable() -> Iterator[None]:
    """Leave ``torch.inference_mode`` for curvkit's curvature passes; a context, or a decorator: ``@differentiable()``.

    Inside inference mode autograd records nothing, even under ``torch.enable_grad()``, so every gradient,
    Jacobian or Hessian product would silently be zero or fail. Every public entry point of curvkit that
    differentiates the model (the exact operators' construction and products, the estimators' updates, the
    Kronecker capture, Laplace's fit and predictives, the Gauss-Newton step, the LLC) runs inside this context: it
    turns inference mode off and keeps the caller's grad mode (off under inference mode, as under
    ``torch.no_grad()``; curvkit enables grad itself where it differentiates), so inference mode behaves as
    ``torch.no_grad()`` does. Tensors created inside inference mode (inputs, vectors) are copied out of it by
    :func:`curvkit.validation.ordinary`. Outside inference mode this does nothing. Nothing is changed for
    the caller: the mode is restored on exit.
    """
    if not torch.is_inference_mode_enabled():
        yield
        return
    grad = torch.is_grad_enabled()
    with torch.inference_mode(False), torch.set_grad_enabled(grad):
        yield


def require_ordinary_parameters(model: nn.Module, what: str) -> None:
    """Raise a ValueError when a parameter or buffer of ``model`` is an inference tensor (the model was built or
    copied inside ``torch.inference_mode()``): autograd can never differentiate through it."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_inference():
            raise ValueError(f"{what}: {name!r} of the model was created inside torch.inference_mode(), so autograd "
                             "cannot differentiate through it; build (or copy) the model outside inference mode "
                             "(curvkit itself runs under any grad mode)")


class UnsupportedModelError(ValueError):
    """A model (or one of its modules) is outside what a route supports; the message says how to fix it."""


def refuse(what: str, label: str, module: nn.Module | None, why: str, fix: str) -> UnsupportedModelError:
    """The one wording of structural errors: ``"{what}: module 'label' (Type) {why}; {fix}"``."""
    kind = f" ({type(module).__name__})" if module is not None else ""
    return UnsupportedModelError(f"{what}: module {label!r}{kind} {why}; {fix}")


@dataclass(frozen=True)
class LayerInfo:
    """A module that owns trainable parameters.

    Attributes:
        label: its qualified name (``'<root>'`` for the model itself).
        module: the module (what it computes is its layer-kind handler's business: :mod:`curvkit.layerkinds`).
        weight: canonical name of its trainable ``weight``, or None (absent or frozen).
        bias: canonical name of its trainable ``bias``, or None.
        params: canonical names of all its trainable parameters (own, not recursive).
    """

    label: str
    module: nn.Module
    weight: str | None
    bias: str | None
    params: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """(weight, bias) names present, weight first (the Kronecker block's parameters)."""
        return tuple(n for n in (self.weight, self.bias) if n is not None)


@dataclass
class MLPChain:
    """A feed-forward chain [Flatten] Linear (act...) Linear ... Linear (thesis Eq. 3.10).

    ``activations[l]`` are applied to the output of ``linears[l]`` (the last list is empty); ``names``
    are the Linear modules' labels; ``weights``/``biases`` their canonical parameter names.
    """

    names: list[str]
    linears: list[nn.Linear]
    activations: list[list[nn.Module]]
    flatten: nn.Module | None
    weights: list[str]
    biases: list[str | None]


def _label(name: str) -> str:
    return name or "<root>"


def is_random(mod: nn.Module) -> bool:
    """Whether ``mod`` is NOW random: Dropout with p > 0 or RReLU, in training mode."""
    if isinstance(mod, DROPOUTS):
        return bool(mod.training and float(getattr(mod, "p", 0.0)) > 0)
    return isinstance(mod, nn.RReLU) and mod.training


def _mixes_samples(mod: nn.Module) -> bool:
    """BatchNorm normalises with batch statistics in training mode (and in eval mode without running
    statistics); the other norms are per sample."""
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        return bool(mod.training or not mod.track_running_stats)
    return False


def sharded_parameters(model: nn.Module) -> list[str]:
    """Names of ``model``'s trainable parameters that are ``DTensor`` shards (FSDP2 ``fully_shard``, tensor
    parallelism). A DTensor exists only once ``torch.distributed.tensor`` is imported, so this imports nothing
    (importing it costs seconds in a fresh process: it pulls in sympy and the symbolic-shape machinery)."""
    DTensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if DTensor is None:
        return []
    return [n for n, p in model.named_parameters() if p.requires_grad and isinstance(p, DTensor)]


def _refuse_sharded_parameters(model: nn.Module) -> None:
    """Refuse a model with sharded trainable parameters (:func:`sharded_parameters`) on a route that reads a
    parameter as the whole tensor on this process: on a shard it would build each rank's curvature of its own
    slice and data without a word (issue 33). The Kronecker estimators take FSDP2 models (with
    ``distributed=``; :class:`curvkit.curvature.KroneckerEstimator`), and so do ``GaussNewton``, ``Laplace`` and the
    exact operators through :func:`curvkit.curvature.sharded_operator` (on a whole-parameter replica)."""
    sharded = sharded_parameters(model)
    if sharded:
        raise NotImplementedError(
            f"parameter {sharded[0]!r} (and {len(sharded) - 1} more) is a DTensor shard (FSDP2 fully_shard or "
            "tensor parallelism): this curvkit route does not compute curvature of sharded models yet. These do, "
            "with distributed=Reducer(): the Kronecker estimators (KroneckerEstimator(model, likelihood, 'kfac', "
            "distributed=Reducer())), GaussNewton, Laplace, and the exact operators through curvkit.curvature."
            "sharded_operator(GGNOperator, model, likelihood, data, distributed=Reducer()). Otherwise use "
            "data parallelism (every rank holds the whole model, pass distributed=Reducer()), or gather a full "
            "replica of the model on each rank (e.g. torch.distributed.checkpoint's get_model_state_dict with "
            "full_state_dict=True loaded into an unsharded copy).")


class ModelStructure:
    """What curvkit knows about a model's structure (module docstring). Build with :func:`read_model`.

    The reading reflects the model at the time it is made (train/eval mode, ``requires_grad`` flags).
    """

    def __init__(self, model: nn.Module, sharded: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not sharded:
            _refuse_sharded_parameters(model)
        #: names of the trainable parameters that are DTensor shards (FSDP2), where the caller takes them
        self.sharded = sharded_parameters(model) if sharded else []
        self.model = model
        module_names: dict[int, list[str]] = {}
        for name, mod in model.named_modules(remove_duplicate=False):
            module_names.setdefault(id(mod), []).append(name)
        #: module -> all the names it is registered under (first = canonical)
        self.module_aliases = {i: tuple(ns) for i, ns in module_names.items()}
        self.modules: list[tuple[str, nn.Module]] = list(model.named_modules())
        canonical: dict[int, str] = {}
        for name, param in model.named_parameters():
            canonical[id(param)] = name
        self._canonical = canonical
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        #: canonical name -> labels of the distinct modules owning it (only where more than one)
        owners: dict[str, list[str]] = {}
        self._param_slots: list[tuple[str, str]] = []  # (slot name, canonical name), one per (module, attr)
        self._buffer_slots: list[tuple[str, str]] = []
        buffer_canonical: dict[int, str] = {}
        for name, buf in model.named_buffers():
            buffer_canonical[id(buf)] = name
        self.layers: list[LayerInfo] = []
        self.leaves: list[tuple[str, nn.Module]] = []
        for mname, mod in self.modules:
            prefix = f"{mname}." if mname else ""
            own_trainable = []
            for attr, slot_param in mod._parameters.items():
                if slot_param is None:
                    continue
                cname = canonical[id(slot_param)]
                self._param_slots.append((prefix + attr, cname))
                owners.setdefault(cname, []).append(_label(mname))
                if cname in trainable:
                    own_trainable.append(cname)
            for attr, slot_buf in mod._buffers.items():
                if slot_buf is not None:
                    self._buffer_slots.append((prefix + attr, buffer_canonical[id(slot_buf)]))
            if own_trainable:
                weight, bias = getattr(mod, "weight", None), getattr(mod, "bias", None)
                wname = canonical.get(id(weight)) if isinstance(weight, Tensor) else None
                bname = canonical.get(id(bias)) if isinstance(bias, Tensor) else None
                self.layers.append(LayerInfo(
                    _label(mname), mod,
                    wname if wname in trainable else None, bname if bname in trainable else None,
                    tuple(own_trainable)))
            if not any(True for _ in mod.children()):
                self.leaves.append((mname, mod))
        self.shared_parameters = {n: tuple(o) for n, o in owners.items() if len(o) > 1 and n in trainable}
        self.reused_modules = {ns[0]: ns for ns in self.module_aliases.values() if len(ns) > 1}
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        self.activations = [(n, m) for n, m in self.leaves if type(m) in ELEMENTWISE]
        self.mixing = [_label(n) for n, m in self.modules if _mixes_samples(m)]
        self.random = [_label(n) for n, m in self.modules if is_random(m)]
        self.inplace = [_label(n) for n, m in self.modules if bool(getattr(m, "inplace", False))]

    # ------------------------------------------------------------------ names
    def label(self, module: nn.Module) -> str:
        """The canonical qualified name of ``module`` (``'<root>'`` for the model)."""
        names = self.module_aliases.get(id(module))
        if names is None:
            raise ValueError(f"{type(module).__name__} is not a submodule of the model")
        return _label(names[0])

    def canonical_name(self, tensor: Tensor) -> str | None:
        """The layout name of a parameter tensor of the model (None if it is not one)."""
        return self._canonical.get(id(tensor))

    @property
    def is_plain_sequential(self) -> bool:
        """The model and every container in it are plain ``nn.Sequential`` (so calls follow the order)."""
        return all(type(m) is nn.Sequential or not any(True for _ in m.children()) for _, m in self.modules)

    # ------------------------------------------------------------------ refusals shared by routes
    def stochastic_reason(self) -> str | None:
        """Why the model's output is random or couples samples, or None."""
        if self.random:
            return (f"module {self.random[0]!r} is random in training mode (Dropout with p > 0 or RReLU); "
                    "call model.eval() for a fixed curvature")
        if self.mixing:
            return (f"module {self.mixing[0]!r} (BatchNorm) normalises with batch statistics, so samples "
                    "are not independent; call model.eval() to use its running statistics")
        return None

    def require_deterministic(self, what: str) -> None:
        """Raise if any module is random in training mode (the curvature would not be a fixed matrix)."""
        if self.random:
            mod = dict(self.modules)[self.random[0] if self.random[0] != "<root>" else ""]
            raise refuse(what, self.random[0], mod, "is random in training mode (its output is not a fixed "
                         "function of the parameters)", "call model.eval() (or set its p to 0)")

    def require_independent_samples(self, what: str, hint: str = "") -> None:
        """Raise if a module couples the samples of a batch (BatchNorm using batch statistics); ``hint`` is a
        further fix the caller offers (the Kronecker estimators' ``batch_statistics='couple'``)."""
        if self.mixing:
            mod = dict(self.modules)[self.mixing[0] if self.mixing[0] != "<root>" else ""]
            raise refuse(what, self.mixing[0], mod, "normalises with batch statistics, so the per-sample "
                         "curvature this route factorises does not exist",
                         "call model.eval() to use its running statistics, or use an exact operator" + hint)

    # ------------------------------------------------------------------ routes
    def mlp_chain(self, what: str, *, frozen: bool = False) -> MLPChain:
        """Parse the model as a feed-forward chain (for the recursions of thesis Lemmas 3.16/3.22, KFRA,
        and the batched SGLD gradient), or raise naming the offending module. ``frozen=True`` also accepts
        Linear layers with frozen parameters (KFRA propagates its recursion through them)."""
        acts = ", ".join(sorted(t.__name__ for t in ELEMENTWISE))
        if type(self.model) is not nn.Sequential:
            raise refuse(what, "<root>", self.model, "is not an nn.Sequential",
                         f"build the model as nn.Sequential([nn.Flatten], nn.Linear, activation, ..., nn.Linear) "
                         f"with activations from: {acts}")
        names: list[str] = []
        linears: list[nn.Linear] = []
        activations: list[list[nn.Module]] = []
        weights: list[str] = []
        biases: list[str | None] = []
        flatten: nn.Module | None = None
        last = ""
        for i, (name, m) in enumerate(self.model.named_children()):
            last = name
            if isinstance(m, nn.Flatten) and i == 0:
                flatten = m
            elif type(m) is nn.Linear:
                names.append(name)
                linears.append(m)
                activations.append([])
                weights.append(self._trainable_name(what, name, m, m.weight, frozen))
                biases.append(None if m.bias is None else self._trainable_name(what, name, m, m.bias, frozen))
            elif type(m) in ELEMENTWISE and not any(True for _ in m.parameters()):
                if not linears:
                    raise refuse(what, name, m, "comes before the first nn.Linear",
                                 "start the chain with nn.Linear (optionally after nn.Flatten)")
                activations[-1].append(m)
            else:
                raise refuse(what, name, m, "is not supported in an MLP chain",
                             f"use nn.Linear layers and elementwise activations ({acts})")
        if not linears:
            raise UnsupportedModelError(f"{what}: the model has no nn.Linear layer")
        if activations[-1]:
            raise refuse(what, last, activations[-1][-1], "comes after the last nn.Linear: the model ends with an activation",
                         "the output must be the likelihood's natural parameter (logits/mean): remove the output "
                         "activation and let the likelihood apply it")
        if self.reused_modules:
            name, aliases = next(iter(self.reused_modules.items()))
            raise refuse(what, _label(name), dict(self.modules)[name], f"is used more than once "
                         f"({', '.join(aliases)})", "use one module per layer")
        for pname, owners in self.shared_parameters.items():
            raise UnsupportedModelError(f"{what}: parameter {pname!r} is shared by modules "
                                        f"{', '.join(repr(o) for o in owners)}; untie the weights")
        return MLPChain(names, linears, activations, flatten, weights, biases)

    def _trainable_name(self, what: str, label: str, mod: nn.Module, p: Tensor, frozen: bool = False) -> str:
        name = self._canonical[id(p)]
        if not p.requires_grad and not frozen:
            raise refuse(what, label, mod, "has frozen parameters",
                         "the recursions need every parameter of the chain to be trainable")
        return name

    # ------------------------------------------------------------------ evaluation
    def functional_call(self, params: Mapping[str, Tensor], args: Any,
                        buffers: Mapping[str, Tensor] | None = None) -> Any:
        """``model(*args)`` with the parameters (and buffers) named in ``params``/``buffers`` (canonical
        names) replaced by the given tensors; the model's own objects are back in place afterwards.

        Parameters not named keep their module values. Works with shared parameters and reused modules,
        inside ``torch.func`` transforms (``vmap``, ``jvp``, ``grad``).
        """
        state: dict[str, Tensor] = {}
        for slot, cname in self._param_slots:
            if cname in params:
                state[slot] = params[cname]
        if buffers is not None:
            for slot, cname in self._buffer_slots:
                if cname in buffers:
                    state[slot] = buffers[cname]
        if not isinstance(args, tuple):
            args = (args,)
        with self._restored(), curvature_kernels():
            return _torch_functional_call(self.model, state, args, tie_weights=False, strict=False)

    @contextmanager
    def _restored(self) -> Iterator[None]:
        saved = [(mod, dict(mod._parameters), dict(mod._buffers)) for _, mod in self.modules]
        try:
            yield
        finally:
            for mod, ps, bs in saved:
                for attr, p in ps.items():
                    if mod._parameters.get(attr) is not p:
                        mod._parameters[attr] = p
                for attr, b in bs.items():
                    if mod._buffers.get(attr) is not b:
                        mod._buffers[attr] = b

    def count_calls(self, modules: Sequence[nn.Module]) -> _CallCounter:
        """A context manager counting the calls of ``modules`` during a forward pass (``.counts``)."""
        return _CallCounter(modules)


class _CallCounter:
    def __init__(self, modules: Sequence[nn.Module]):
        self.modules = list(modules)
        self.counts = [0] * len(self.modules)
        self._handles: list[Any] = []

    def __enter__(self) -> _CallCounter:
        for i, m in enumerate(self.modules):
            self._handles.append(m.register_forward_hook(self._hook(i)))
        return self

    def _hook(self, i: int) -> Callable[..., None]:
        def fn(*_: Any) -> None:
            self.counts[i] += 1
        return fn

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def require_fixed_mode(model: nn.Module, what: str, batch_statistics: bool = False, hint: str = "") -> None:
    """Raise if ``model`` NOW has a module that is random (Dropout with p > 0, RReLU in training mode) or
    couples the samples (BatchNorm with batch statistics; accepted with ``batch_statistics=True``, for users
    built with the explicit opt-in to the coupled Kronecker factors): for users that read the model once and
    run it many times (an optimiser), since ``model.train()`` after construction changes what the forward pass
    is. ``hint`` is a further fix for the coupling refusal. One pass over the modules, no forward pass."""
    for name, mod in model.named_modules():
        if is_random(mod):
            raise refuse(what, _label(name), mod, "is random in training mode (model.train() was called after "
                         f"{what} was created)", "call model.eval() (or set its p to 0) before the step")
        if _mixes_samples(mod) and not batch_statistics:
            raise refuse(what, _label(name), mod, "normalises with batch statistics (model.train() was called "
                         f"after {what} was created), so the per-sample curvature does not exist",
                         "call model.eval() before the step, to use its running statistics" + hint)


def couples_samples(model: nn.Module) -> bool:
    """Whether ``model`` NOW has a module that normalises with batch statistics (BatchNorm in training mode,
    or without running statistics)."""
    return any(_mixes_samples(m) for m in model.modules())


def running_statistics(model: nn.Module) -> list[tuple[nn.Module, str, Tensor]]:
    """(module, buffer name, buffer) for every buffer of a module that NOW normalises with batch statistics
    (BatchNorm in training mode: ``running_mean``, ``running_var``, ``num_batches_tracked``), which a forward
    pass updates."""
    return [(m, attr, b) for m in model.modules() if _mixes_samples(m) for attr, b in m._buffers.items()
            if b is not None]


@contextmanager
def kept_running_statistics(model: nn.Module) -> Iterator[None]:
    """Run forward passes that must not change the model's BatchNorm running statistics (curvature passes,
    re-evaluations): every buffer of a module that normalises with batch statistics (``running_mean``,
    ``running_var``, ``num_batches_tracked``) is replaced by a copy for the duration, and the module's own
    tensor is put back on exit (also on error), never written to. A backward pass through a graph built
    inside may run after the exit (the copies stay alive in it). A no-op without such modules."""
    saved = running_statistics(model)
    for m, attr, b in saved:
        m._buffers[attr] = b.detach().clone()
    try:
        yield
    finally:
        for m, attr, b in saved:
            m._buffers[attr] = b


def read_model(model: nn.Module, *, sharded: bool = False) -> ModelStructure:
    """Read ``model``'s structure once (see :class:`ModelStructure` and the module docstring); a
    ``torch.compile``'d model is read as the module it compiles (:func:`uncompiled`). A model with sharded
    (FSDP2 ``DTensor``) trainable parameters is refused unless the caller takes them (``sharded=True``; they are
    listed in ``structure.sharded``)."""
    return ModelStructure(uncompiled(model), sharded)


def uncompiled(model: Any) -> Any:
    """The module that ``torch.compile(module)`` wraps (its ``_orig_mod``, through nested compiles), else ``model``.

    curvkit's curvature passes hook layers, call the model inside ``torch.func`` transforms and differentiate
    twice, which compiled graphs do not support (or recompile for, pass after pass); the compiled wrapper and
    its module share their parameters and compute the same function, so every entry point that takes a model
    holds this module instead: the numbers, the parameter names (without the ``_orig_mod.`` prefix) and the
    automatic choices are those of the uncompiled model. The compiled model stays the user's, for training."""
    while isinstance(model, nn.Module) and type(model).__name__ == "OptimizedModule" \
            and type(model).__module__.startswith("torch._dynamo") and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model
