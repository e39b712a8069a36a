"""Functional-call machinery shared by the exact curvature operators.

* :func:`as_batches` turns ``data`` (an ``(X, y)`` pair or an iterable of pairs) into a list of validated
  pairs (:func:`curvkit.validation.iter_batches`, materialised). ``X`` is a tensor or a mapping of tensors
  (:data:`curvkit.validation.Inputs`); the model is called as ``model(X)`` either way.
* :class:`FunctionalModel` snapshots a module's parameters and buffers and evaluates the module as a pure
  function ``f(params, X)`` of a tuple of trainable-parameter tensors (``torch.func.functional_call``),
  which is what ``torch.func.jvp`` / ``vjp`` / ``grad`` / ``vmap`` need.
* :func:`cols_to_params` / :func:`params_to_cols` convert between a (d, k) matrix of flat columns and a
  tuple of parameter tensors with a leading column dimension, (k, *shape) (the layout is
  :class:`curvkit.linalg.layout.ParamLayout`: row-major, ``named_parameters()`` order).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from curvkit import precision
from curvkit.hf import require_wrapped
from curvkit.likelihoods import Likelihood
from curvkit.linalg.layout import ParamLayout
from curvkit.structure import read_model, require_ordinary_parameters, uncompiled
from curvkit.validation import Inputs, describe_inputs, iter_batches, map_inputs, num_samples

Params = tuple[Tensor, ...]
Batch = tuple[Inputs, Tensor]


def as_batches(data: Any, device: torch.device | None = None) -> list[Batch]:
    """:func:`iter_batches` materialised into a list (for operators that re-read the data per product); X a
    tensor or a mapping of tensors."""
    return list(iter_batches(data, device, mappings=True))


def as_tensor_batches(data: Any) -> list[tuple[Tensor, Tensor]]:
    """:func:`as_batches` for readers that take tensor inputs only (a mapping batch is refused)."""
    return list(iter_batches(data))


def _flat_snapshot(params: list[Tensor], layout: ParamLayout) -> Params:
    """Copies of ``params`` as views of ONE flat buffer at their layout offsets: a forward-mode tangent
    taken from a flat (d, k) column (:func:`cols_to_params`) then has the same storage layout as its
    primal, so ``make_dual`` uses it as it is instead of copying it (a parameter-sized copy per product)."""
    if not params:
        return ()
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    return tuple(flat[o:o + n].view(p.shape) for o, n, p in zip(layout.offsets, layout.numels, params))


class FunctionalModel:
    """A module evaluated as ``f(params, X)`` at a fixed snapshot of its state.

    At construction the trainable parameters (``requires_grad=True``, in ``named_parameters()`` order,
    which fixes the flat layout) are copied with ``.detach().clone()``, as are the frozen parameters and
    the buffers; later changes to the module (an optimiser step) do not affect the snapshot, and
    evaluating never changes the module. With ``snapshot=False`` nothing is copied: the module's own tensors are
    held (detached views), which saves one copy of the parameters, frozen parameters and buffers (650 MB
    for GPT-2-small), and :meth:`check_unchanged` (called by every evaluation) raises a ``RuntimeError``
    once any of them has been changed in place (an optimiser step, ``copy_``, a running-statistics update),
    read from PyTorch's version counters; so an evaluation is still that of the state at construction, or
    an error. Changes through ``.data`` bypass the version counter and are NOT detected; a parameter
    replaced by a new tensor (``module.weight = nn.Parameter(...)``) leaves the held one in place (shared parameters and modules registered under two names
    included: :meth:`curvkit.structure.ModelStructure.functional_call`). The module's train/eval mode is
    NOT frozen: the mode it is in when a product is computed is used. A module that is random in training
    mode (Dropout with p > 0) is refused at construction; one that couples samples (BatchNorm in training
    mode) is evaluated on the whole batch, with fresh copies of its buffers each time so the snapshot's
    running statistics never change, and ``batch_coupled`` tells per-sample routes to step aside.
    """

    def __init__(self, module: nn.Module, what: str = "curvature operator", snapshot: bool = True,
                 compute_dtype: torch.dtype | None = None):
        if snapshot not in (True, False):
            raise ValueError(f"snapshot must be True (copy the model's state) or False (hold its tensors), "
                             f"got {snapshot!r}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
        module = uncompiled(module)
        require_wrapped(module, what)
        require_ordinary_parameters(module, what)
        self.module = module
        self.structure = read_model(module)
        self.structure.require_deterministic(what)
        self.batch_coupled = bool(self.structure.mixing)
        self.layout = ParamLayout.from_module(module)
        named = dict(module.named_parameters())
        self.names = self.layout.names
        dtypes = {named[n].dtype for n in self.names}
        devices = {named[n].device for n in self.names}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"all trainable parameters must share one dtype and device, got dtypes {dtypes} "
                             f"and devices {devices}")
        self.what = what
        trainable: list[Tensor] = [named[n] for n in self.names]
        self.params: Params = (_flat_snapshot(trainable, self.layout) if snapshot
                               else tuple(p.detach() for p in trainable))
        if not self.params[0].dtype.is_floating_point:
            raise ValueError(f"parameters must be floating point, got {self.params[0].dtype}")
        self.dtype: torch.dtype = precision.compute_dtype(self.params[0].dtype, compute_dtype)
        self.device: torch.device = self.params[0].device
        keep = (lambda t: t.detach().clone()) if snapshot else (lambda t: t.detach())
        trainable_names = set(self.names)
        self.frozen: dict[str, Tensor] = {n: keep(p) for n, p in module.named_parameters()
                                          if n not in trainable_names}
        self.buffers: dict[str, Tensor] = {n: keep(b) for n, b in module.named_buffers()}
        held = [*zip(self.names, self.params), *self.frozen.items(), *self.buffers.items()]
        self._versions = [] if snapshot else [(n, t, t._version) for n, t in held]
        #: the passes run in ``compute_dtype`` (curvkit.precision): an upcast copy of the held state
        self.upcast = compute_dtype is not None and (self.dtype != self.params[0].dtype or any(
            t.is_floating_point() and torch.finfo(t.dtype).bits < torch.finfo(self.dtype).bits
            for t in [*self.frozen.values(), *self.buffers.values()]))
        if self.upcast:
            self._versions = []  # the copies are the snapshot: later changes of the model do not reach them
            self.params = _flat_snapshot([p.to(self.dtype) for p in self.params], self.layout)
            self.frozen = precision.upcast_state(self.frozen, self.dtype)
            self.buffers = precision.upcast_state(self.buffers, self.dtype)

    def check_unchanged(self) -> None:
        """Raise if a tensor held with ``snapshot=False`` was changed in place since construction."""
        for name, t, version in self._versions:
            if t._version != version:
                raise RuntimeError(
                    f"{self.what}: {name!r} of the model was changed in place after the {self.what} was built "
                    "with snapshot=False (an optimiser step?), so its results would no longer be those of the "
                    "model it was built at; build a new one after changing the model, or build it with "
                    "snapshot=True (the default), which keeps a copy of the parameters")

    def __call__(self, params: Params, X: Inputs) -> Tensor:
        self.check_unchanged()
        if self.upcast:
            X = precision.upcast_inputs(X, self.dtype)
        state = dict(self.frozen)
        state.update(zip(self.names, params))
        buffers = {n: b.clone() for n, b in self.buffers.items()} if self.batch_coupled else self.buffers
        return self.structure.functional_call(state, (X,), buffers)  # type: ignore[no-any-return]

    def single(self, params: Params, x: Inputs) -> Tensor:
        """Output for ONE sample ``x`` (no batch dimension; a mapping: every tensor without it), shape (C,)
        or (*P, C)."""
        return self(params, map_inputs(lambda t: t.unsqueeze(0), x))[0]


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


def checked_output(fmodel: FunctionalModel, likelihood: Likelihood, X: Inputs, y: Tensor | None,
                   batch_index: int) -> Tensor:
    """Model output at the snapshot, validated: (B, C) or (B, *P, C), finite, targets as the head needs."""
    with torch.no_grad():
        f = fmodel(fmodel.params, X)
    return check_output(f, likelihood, X, y, batch_index)


def check_output(f: Any, likelihood: Likelihood, X: Inputs, y: Tensor | None, batch_index: int) -> Tensor:
    """Validate an already computed model output ``f`` for batch ``X`` (see :func:`checked_output`): one
    tensor whose first dimension is the batch and whose LAST is the outputs (classes), with any position
    dimensions between them; the likelihood checks finiteness and that the targets match."""
    if not isinstance(f, Tensor):
        raise TypeError(f"the model must return one tensor of shape (batch, outputs) or (batch, positions..., "
                        f"outputs), got {type(f).__name__}{_adapter_hint(f)}")
    B = num_samples(X)
    if f.dim() < 2 or f.shape[0] != B:
        raise ValueError(
            f"batch {batch_index}: the model output must have shape (batch, outputs) = ({B}, C) or "
            f"(batch, positions..., outputs) = ({B}, ..., C), got {tuple(f.shape)} for inputs "
            f"{describe_inputs(X)}; flatten or reshape it inside the model (e.g. end with nn.Flatten())"
        )
    try:
        likelihood.check(f.detach(), y)
    except ValueError as err:
        raise ValueError(f"batch {batch_index}: {err}") from None
    return f


def _adapter_hint(out: Any) -> str:
    """A hint for a model that returns a mapping (a Hugging Face ``ModelOutput``) instead of a tensor."""
    if isinstance(out, Mapping):
        keys = ", ".join(repr(k) for k in out)
        return (f" with keys {keys}; wrap the model so that it returns the logits tensor, e.g. "
                "curvkit.hf.HuggingFace(model, output='logits')")
    return ""
