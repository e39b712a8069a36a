"""The conventions every curvkit optimiser follows (``docs/architecture.md``, "Optimisers").

* **Construction** like ``torch.optim``: ``Opt(params, *, model=None, likelihood=None, **hyperparameters)``.
  ``params`` is an iterable of parameters or of param groups (dicts); hyperparameters are defaults that a
  group may override. An optimiser that needs the layer structure or evaluates the model functionally
  takes the model through the keyword ``model=`` (and the loss head through ``likelihood=``); every
  optimised parameter must belong to it.
* **Frozen parameters** (``requires_grad=False`` when the optimiser is built) are dropped from the param
  groups (:func:`trainable_params`), so ``model.parameters()`` of a model with a frozen base is accepted
  and, as in ``torch.optim``, a frozen parameter is never changed, holds no state, gets no curvature and
  is not counted in any dimension. A group left empty stays (group indices keep their meaning); an
  optimiser with no trainable parameter at all is refused. The same holds for ``add_param_group`` later
  (unfreeze first, then add: a group added after construction whose parameters are all frozen is refused).
* **Stepping**: ``step(closure=None, *, batch=None, **extras)``. ``closure()`` re-evaluates the loss and
  calls ``backward()`` (torch.optim semantics); ``batch=(X, y)`` is how an optimiser that computes its
  own curvature or Monte Carlo gradients receives the minibatch; optimiser-specific per-step inputs are
  further keyword arguments, and unknown names are refused. ``step`` returns the loss when it knows it.
* **Curvature**: ``opt.curvature()`` returns what the optimiser currently holds as a
  :class:`~curvkit.linalg.operator.CurvatureOperator` over its parameters (a Hessian-diagonal estimate,
  a posterior precision, a Fisher).
* **Posterior mean**: ``with opt.posterior_mean(): ...`` evaluates a Bayesian optimiser at its posterior
  mean (a no-op where the parameters already hold it).
* **Hooks**: an optimiser that installs hooks removes them in :meth:`CurvatureOptimizer.close` (also on
  ``with``-exit and when it is garbage collected).
* **Nothing lost, nothing half-written**: before writing, a step checks every new parameter and state
  value (:func:`check_finite`) and raises without changing anything when one is NaN or inf.
* **Checkpointing**: ``state_dict()`` / ``load_state_dict()`` carry everything a resumed run needs
  (random generators and step counters included), so a stopped and resumed run equals an uninterrupted
  one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from curvkit.linalg.layout import ParamLayout
from curvkit.structure import uncompiled

GroupChecks = Mapping[str, Callable[[str, Any], Any]]

__all__ = ["CurvatureOptimizer", "GroupChecks", "check_finite", "check_step_extras", "legacy_model_first",
           "trainable_params"]


def _tensor_of(entry: Any) -> Any:
    """The tensor of a ``params`` entry: a tensor or a ``(name, tensor)`` pair (torch.optim's named form)."""
    return entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry


def _is_frozen(entry: Any) -> bool:
    t = _tensor_of(entry)
    return isinstance(t, Tensor) and not t.requires_grad


def trainable_params(params: Iterable[Any]) -> list[Any]:
    """The entries of ``params`` (tensors or ``(name, tensor)`` pairs) whose tensor has
    ``requires_grad=True``: the parameters an optimiser may change. Anything that is not a tensor is kept,
    for torch.optim to refuse with its own message."""
    return [e for e in params if not _is_frozen(e)]


def _trainable_group(param_group: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(``param_group`` without its frozen entries (explicit ``param_names`` filtered alongside), the number
    of entries dropped)."""
    params = param_group.get("params")
    if isinstance(params, Tensor):
        params = [params]
    elif params is None or isinstance(params, set):  # torch.optim refuses these with its own message
        return param_group, 0
    params = list(params)
    keep = [i for i, e in enumerate(params) if not _is_frozen(e)]
    out = dict(param_group, params=[params[i] for i in keep])
    names = param_group.get("param_names")
    if isinstance(names, (list, tuple)) and len(names) == len(params):
        out["param_names"] = [names[i] for i in keep]
    return out, len(params) - len(keep)


class CurvatureOptimizer(Optimizer):
    """Base class of the curvkit optimisers: ``curvature()``, ``posterior_mean()``, ``close()`` and the
    parameter names of an optional ``model``."""

    model: nn.Module | None = None

    #: per-group hyperparameter checks, name -> check(name, value) raising ValueError (``curvkit.validation``);
    #: applied to every param group, so a group cannot override a default with a NaN, an inf or a
    #: negative value that the constructor would have refused
    group_checks: ClassVar[GroupChecks] = {}

    def __init__(self, params: Any, defaults: dict[str, Any]):
        super().__init__(params, defaults)
        if not any(g["params"] for g in self.param_groups):
            raise ValueError(f"{type(self).__name__}: none of the given parameters is trainable (every one has "
                             "requires_grad=False), so there is nothing to optimise; unfreeze the parameters to "
                             "train with requires_grad_(True)")
        self._built = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's ``add_param_group`` for the trainable entries of ``param_group`` only (frozen
        parameters are dropped: module docstring), then the per-group hyperparameter checks."""
        if isinstance(param_group, dict):
            param_group, dropped = _trainable_group(param_group)
            if getattr(self, "_built", False) and dropped and not param_group["params"]:
                raise ValueError(f"{type(self).__name__}.add_param_group: every parameter of the group is frozen "
                                 "(requires_grad=False) and a frozen parameter is never optimised; call "
                                 "requires_grad_(True) on them first, then add the group")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for name, check in self.group_checks.items():
            if name in group and group[name] is not None:
                check(name, group[name])

    def _init_names(self, model: nn.Module | None) -> Any:
        """Record ``model`` (a compiled one as the module it compiles) and check that every optimised parameter
        belongs to it; returns the recorded model."""
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        model = self.model = uncompiled(model)  # the same parameters (curvkit.structure.uncompiled)
        if model is None:
            return None
        names = {id(p): n for n, p in model.named_parameters()}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(f"param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a "
                                     f"parameter of the model given as model=; pass model.parameters() (or a "
                                     "subset of them)")
        return model

    def first_param(self) -> Tensor:
        """The first optimised parameter (its device and dtype are the optimiser's); groups may be empty."""
        return next(p for g in self.param_groups for p in g["params"])

    def param_names(self) -> list[str]:
        """Names of the optimised parameters in the model's ``named_parameters`` order (group order
        without a model: ``group{i}.param{j}``)."""
        owned = {id(p) for g in self.param_groups for p in g["params"]}
        if self.model is not None:
            return [n for n, p in self.model.named_parameters() if id(p) in owned]
        return [f"group{i}.param{j}" for i, g in enumerate(self.param_groups) for j in range(len(g["params"]))]

    def ordered_params(self) -> list[Tensor]:
        """The optimised parameters in :meth:`param_names` order."""
        owned = {id(p) for g in self.param_groups for p in g["params"]}
        if self.model is not None:
            return [p for _, p in self.model.named_parameters() if id(p) in owned]
        return [p for g in self.param_groups for p in g["params"]]

    def layout(self) -> ParamLayout:
        """The :class:`ParamLayout` of :meth:`curvature` (names and shapes of the optimised parameters)."""
        params = self.ordered_params()
        return ParamLayout(tuple(self.param_names()), tuple(p.shape for p in params))

    def curvature(self) -> Any:
        """The curvature the optimiser holds now, as a CurvatureOperator (subclasses implement it)."""
        raise NotImplementedError(f"{type(self).__name__} holds no curvature estimate")

    @contextmanager
    def posterior_mean(self) -> Iterator[None]:
        """Evaluate at the posterior mean inside the context (no-op: the parameters hold it)."""
        yield

    def close(self) -> None:
        """Remove any hooks the optimiser installed (idempotent)."""

    def __enter__(self) -> CurvatureOptimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def check_finite(step: int, values: Iterable[tuple[str, Tensor]], what: str, hint: str = "") -> None:
    """Raise FloatingPointError naming the first of ``values`` (name, tensor) with a NaN or inf entry.

    Called by a step BEFORE it writes anything, so the optimiser's state and the parameters are unchanged
    when it raises."""
    for name, t in values:
        if t.is_floating_point() and not bool(torch.isfinite(t.sum())):
            raise FloatingPointError(
                f"{what}: step {step} would write NaN or inf into {name}; nothing was changed. "
                + (hint or "Check the loss and its gradient (a NaN gradient with a finite loss usually means "
                            "an overflow or a log/sqrt of a non-positive number in the model)"))


def check_step_extras(opt_name: str, extras: dict[str, Any], allowed: Iterable[str]) -> None:
    """Refuse per-step keyword inputs that the optimiser does not know (a misspelt name does nothing
    otherwise)."""
    allowed = set(allowed)
    unknown = sorted(k for k in extras if k not in allowed)
    if unknown:
        raise TypeError(f"{opt_name}.step() got unknown keyword argument(s) {unknown}; it accepts "
                        f"{sorted(allowed) or 'no extra inputs'}")


def legacy_model_first(cls_name: str, params: Any, model: nn.Module | None) -> tuple[Any, nn.Module | None]:
    """Support the pre-0.2 ``Opt(model, ...)`` form for one release: a module passed where the parameters
    go becomes ``model=`` (its trainable parameters are optimised), with a DeprecationWarning."""
    if isinstance(params, nn.Module):
        if model is not None and model is not params:
            raise TypeError(f"{cls_name}: got a module as params and a different model=")
        warnings.warn(f"{cls_name}(model, ...) is deprecated; use {cls_name}(model.parameters(), model=model, ...)",
                      DeprecationWarning, stacklevel=3)
        model = params
        params = [p for p in model.parameters() if p.requires_grad]
    return params, model
