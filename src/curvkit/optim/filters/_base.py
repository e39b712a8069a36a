"""Shared machinery of the Bayesian-filtering optimisers (Aitchison 2018).

Conventions used by every filter in :mod:`curvkit.optim.filters`:

* **Loss scale.** The filters are derived for the *summed* minibatch log-likelihood
  ``log P(d(t)|z) = sum_n log p(y_n|x_n, z)``. PyTorch losses are usually mean-reduced, so the
  optimiser needs the reduction: with ``reduction="mean"`` the ascent gradient is
  ``g = -batch_size * p.grad`` (``batch_size`` given at construction, or per call to ``step``); with
  ``reduction="sum"`` it is ``g = -p.grad``.
* **Lookahead bookkeeping** (paper Sec. 2.2.4 and Eqs. 3a, 5). After ``step`` the parameters hold the
  *prior* mean ``mu_prior(t+1) = (I - A) mu_post(t)`` (decay and momentum already applied, which is what
  gives Nesterov acceleration and decoupled weight decay); the posterior mean ``mu_post(t)`` lives in
  ``state["mu_post"]``. :meth:`FilterOptimizer.posterior_mean` swaps it in for evaluation.
* **Initialisation.** The initial parameters are taken as ``mu_prior(1)`` (no decay is applied before
  the first forward pass) and the state starts at the stationary prior covariance where it exists (the
  paper does not say how to initialise; this is the choice made here).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor

from curvkit.optim.base import CurvatureOptimizer
from curvkit.validation import nonnegative, positive, unit_interval

Reduction = Literal["mean", "sum"]


def check_positive(name: str, value: float, allow_inf: bool = False, allow_zero: bool = False) -> float:
    """A scalar hyperparameter > 0 (>= 0 with ``allow_zero``) as a float: :func:`curvkit.validation.positive`
    or :func:`~curvkit.validation.nonnegative`, the one check and wording."""
    return (nonnegative if allow_zero else positive)(name, value, allow_inf=allow_inf)


def check_unit_interval(name: str, value: float, closed_left: bool = False) -> float:
    """A number in (0, 1) ([0, 1) with ``closed_left``): :func:`curvkit.validation.unit_interval`."""
    return unit_interval(name, value, closed_left=closed_left)


class LossScale:
    """Converts ``p.grad`` of the user's loss into the ascent gradient of the summed log-likelihood."""

    def __init__(self, reduction: Reduction, batch_size: int | None):
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if batch_size is not None and (int(batch_size) != batch_size or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.reduction = reduction
        self.batch_size = None if batch_size is None else int(batch_size)

    def factor(self, batch_size: int | None = None) -> float:
        """Multiplier turning ``p.grad`` into a gradient of the summed loss."""
        if self.reduction == "sum":
            return 1.0
        b = batch_size if batch_size is not None else self.batch_size
        if b is None:
            raise ValueError(
                "reduction='mean' needs the minibatch size: pass batch_size=B to the optimiser "
                "(or to step()), or use a sum-reduced loss with reduction='sum'"
            )
        if int(b) != b or b < 1:
            raise ValueError(f"batch_size must be a positive integer, got {b!r}")
        return float(b)

    def default_batch(self) -> int:
        return 1 if self.reduction == "sum" and self.batch_size is None else (self.batch_size or 1)


def ascent_grad(p: Tensor, scale: float, name: str) -> Tensor:
    """``g = -scale * p.grad`` with a finiteness check."""
    if p.grad is None:
        raise ValueError(f"parameter {name} has no gradient; call loss.backward() before step()")
    if p.grad.is_sparse:
        raise ValueError("Bayesian-filtering optimisers do not support sparse gradients")
    if not all_finite(p.grad):
        raise ValueError(f"gradient of parameter {name} contains NaN or inf; check the loss and the learning rates")
    return p.grad.mul(-scale)


def all_finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite, from one reduction: a NaN or inf entry makes the sum NaN or inf.
    (``torch.isfinite(t).all()`` is about 25x slower on CPU.) A finite tensor whose sum overflows counts as
    non-finite; such entries (about 1e38 / numel) are far beyond any usable gradient."""
    return bool(torch.isfinite(t.sum()))


def stationary_variance(sigma2: float, s0: float | None, lr_sgd: float, batch: int) -> float:
    """Initial posterior variance (the paper gives none): the stationary prior sigma^2 if finite, else ``s0``
    or ``lr_sgd / B`` (an SGD-like warm start, as in the author's later AdaBayes code)."""
    if s0 is not None:
        return check_positive("s0", s0)
    if math.isfinite(sigma2):
        return sigma2
    return lr_sgd / batch


class FilterOptimizer(CurvatureOptimizer):
    """Base class: parameter names, loss scaling and posterior-mean swapping. Pass
    ``model.named_parameters()`` as ``params`` to name the parameters in :meth:`curvature` and
    :meth:`effective_lr`."""

    def __init__(self, params: Any, defaults: dict[str, Any], reduction: Reduction, batch_size: int | None):
        self.loss_scale = LossScale(reduction, batch_size)
        super().__init__(params, defaults)

    # ---------------------------------------------------------------- names and layout
    def _named_params(self) -> Iterator[tuple[str, Tensor, dict[str, Any]]]:
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for pi, p in enumerate(group["params"]):
                name = names[pi] if names is not None else f"group{gi}.param{pi}"
                yield name, p, group

    def _layout(self) -> Any:
        from curvkit.linalg.layout import ParamLayout

        named = [(n, p) for n, p, _ in self._named_params()]
        return ParamLayout(tuple(n for n, _ in named), tuple(p.shape for _, p in named))

    # ---------------------------------------------------------------- posterior mean
    @contextmanager
    def posterior_mean(self) -> Iterator[None]:
        """Temporarily load ``mu_post`` into the parameters (for evaluation or checkpoint export).

        Outside the context the parameters hold ``mu_prior``, the point where the next gradient is taken.
        Before the first step both coincide and nothing is swapped.
        """
        saved: list[tuple[Tensor, Tensor]] = []
        with torch.no_grad():
            for _, p, _ in self._named_params():
                st = self.state.get(p, {})
                if "mu_post" in st:
                    saved.append((p, p.detach().clone()))
                    p.copy_(st["mu_post"])
        try:
            yield
        finally:
            with torch.no_grad():
                for p, old in saved:
                    p.copy_(old)

    # ---------------------------------------------------------------- interface
    def posterior_precision(self) -> Any:
        """Deprecated name of :meth:`curvature`."""
        warnings.warn(f"{type(self).__name__}.posterior_precision() is deprecated; use curvature()",
                      DeprecationWarning, stacklevel=2)
        return self.curvature()

    def curvature(self) -> Any:  # pragma: no cover - abstract
        """The filter's current posterior precision as a curvkit curvature operator."""
        raise NotImplementedError

    def effective_lr(self) -> dict[str, Tensor]:  # pragma: no cover - abstract
        """Per-tensor effective SGD learning rate on the user's loss (step = -lr_eff * p.grad)."""
        raise NotImplementedError


FISHER_MODES = ("empirical", "centered", "given")


def check_fisher_mode(mode: str) -> str:
    if mode not in FISHER_MODES:
        raise ValueError(
            f"curvature must be one of {FISHER_MODES}, got {mode!r} ('empirical': e = g as in Adam/RMSProp; "
            "'centered': e = g - EMA(g); 'given': pass fisher_diag=[...] to step(), e.g. squared "
            "sampled-label gradients of the summed loss)"
        )
    return mode


def fisher_square(mode: str, g: Tensor, state: dict[str, Any], given: Tensor | None, name: str,
                  center_beta: float = 0.9) -> Tensor:
    """e^2 for one tensor. ``given`` is a diagonal Fisher estimate in summed-loss units.

    The paper (Sec. 2.1, after Eq. 6) asks for a centred gradient e = g - g_hat or a gradient with labels
    sampled from the model; ``'empirical'`` (e = g, what Adam and RMSProp use) is offered as well.

    Returns a new tensor that the caller may overwrite in place (the update rules use it as scratch)."""
    if mode == "empirical":
        return g * g
    if mode == "centered":
        if "g_avg" not in state:
            state["g_avg"] = torch.zeros_like(g)
        e = g - state["g_avg"]
        state["g_avg"].mul_(center_beta).add_(g, alpha=1 - center_beta)
        return e * e
    if given is None:
        raise ValueError("curvature='given' needs step(fisher_diag=[...]) with one tensor per parameter")
    if given.shape != g.shape:
        raise ValueError(f"fisher_diag for {name} has shape {tuple(given.shape)}, expected {tuple(g.shape)}")
    if not all_finite(given) or bool((given < 0).any()):
        raise ValueError(f"fisher_diag for {name} must be finite and non-negative")
    return given.to(dtype=g.dtype, device=g.device, copy=True)


def split_given(given: Any, n: int) -> list[Tensor | None]:
    if given is None:
        return [None] * n
    given = list(given)
    if len(given) != n:
        raise ValueError(f"fisher_diag must hold one tensor per parameter ({n}), got {len(given)}")
    return given
