"""Textbook damped natural gradient, the paper's equations 5-7 taken literally (digest 003 section 2.3).

    w <- w - η F_s⁻¹ ∇L,    F_s = F + κ I,    κ = (α / d) · max(tr F, ε),            (eq. 5-7)

with d the total number of parameters and F the Fisher of the model's predictive distribution at the
current parameters on the current minibatch. As κ -> ∞ the step tends to SGD with learning rate η/κ.
Unlike :class:`curvkit.optim.kaldi_ngd.KaldiNGD` (what the paper's authors ran) there is no norm
preservation and no running average; the Fisher is recomputed on every ``step(data)``.

Fisher representations (``fisher=``):
* ``"exact"`` - :class:`curvkit.curvature.FisherOperator` (type-2 Fisher, exact expectation over the
  model's predictive; for softmax cross-entropy this is the GGN), made dense: O(d²) memory, for small
  models (d <= ``max_exact_dim``).
* ``"kfac"`` - :func:`curvkit.curvature.kronecker.kfac` (a KroneckerOperator); κ uses its exact trace
  and the step uses ``.inverse(damping=κ)``.
* ``"auto"`` - exact when d <= ``max_exact_dim``, otherwise KFAC.

Momentum (heavy-ball / Nesterov, torch SGD formula) is applied after preconditioning.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import CurvatureOperator


def paper_kappa(trace_f: float, d: int, alpha: float, epsilon: float) -> float:
    """κ = (α/d) · max(tr F, ε)  (paper eq. 7)."""
    return alpha / d * max(float(trace_f), epsilon)


def damped_direction(fisher: CurvatureOperator | Tensor, grad: Tensor, alpha: float, epsilon: float) -> tuple[Tensor, float]:
    """(F + κI)⁻¹ g with the paper's κ, for a dense (d, d) matrix or an operator with ``inverse``/``solve``.

    Returns the flat (d,) direction and κ.
    """
    if isinstance(fisher, Tensor):
        d = fisher.shape[0]
        kappa = paper_kappa(float(torch.trace(fisher)), d, alpha, epsilon)
        A = fisher + kappa * torch.eye(d, dtype=fisher.dtype, device=fisher.device)
        return torch.linalg.solve(A, grad.to(fisher.dtype)), kappa
    d = fisher.layout.dim
    kappa = paper_kappa(float(fisher.trace()), d, alpha, epsilon)
    if kappa <= 0:
        raise ValueError("the damping kappa is 0 (alpha = 0 or a zero Fisher with epsilon = 0); the Fisher "
                         "may be singular: use alpha > 0 and epsilon > 0")
    inv = getattr(fisher, "inverse", None)
    if inv is not None:
        return inv(kappa) @ grad.to(fisher.dtype), kappa
    return fisher.solve(grad.to(fisher.dtype), damping=kappa), kappa


class NaturalGradient(Optimizer):
    """Damped NGD (paper eq. 5-7). Call ``loss.backward()`` then ``opt.step((x, y))`` with the batch.

    Args: ``model`` (its trainable parameters are optimised; one parameter group), ``likelihood``
    (a curvkit Likelihood, e.g. ``CrossEntropy()``), ``lr`` = η, ``alpha`` and ``epsilon`` of eq. 7,
    ``fisher`` ("exact" | "kfac" | "auto"), ``momentum``, ``nesterov``.
    """

    def __init__(self, model: nn.Module, likelihood: Any, lr: float = 1e-2, alpha: float = 0.01,
                 epsilon: float = 1e-10, fisher: str = "auto", momentum: float = 0.0, nesterov: bool = False,
                 max_exact_dim: int = 3000):
        if fisher not in ("exact", "kfac", "auto"):
            raise ValueError(f"fisher must be 'exact', 'kfac' or 'auto', got {fisher!r}")
        if not (lr > 0 and alpha >= 0 and epsilon >= 0 and momentum >= 0):
            raise ValueError(f"need lr > 0, alpha >= 0, epsilon >= 0, momentum >= 0; got lr={lr}, "
                             f"alpha={alpha}, epsilon={epsilon}, momentum={momentum}")
        if alpha == 0 and epsilon == 0:
            raise ValueError("alpha = epsilon = 0 gives no damping; the Fisher is singular for nets: set alpha > 0")
        params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, dict(lr=lr, alpha=alpha, epsilon=epsilon, momentum=momentum, nesterov=nesterov))
        self.model, self.likelihood = model, likelihood
        self.layout = ParamLayout.from_module(model)
        kind = fisher
        if kind == "auto":
            kind = "exact" if self.layout.dim <= max_exact_dim else "kfac"
        if kind == "exact" and self.layout.dim > max_exact_dim:
            raise ValueError(f"fisher='exact' builds a dense {self.layout.dim}^2 matrix; d exceeds "
                             f"max_exact_dim={max_exact_dim}: use fisher='kfac'")
        self.fisher_kind = kind
        self.last_kappa = math.nan

    def fisher(self, data: tuple[Tensor, Tensor]) -> CurvatureOperator | Tensor:
        if self.fisher_kind == "exact":
            from curvkit.curvature import FisherOperator

            return FisherOperator(self.model, self.likelihood, data).to_dense()
        from curvkit.curvature.kronecker import kfac

        return kfac(self.model, self.likelihood, data)

    @torch.no_grad()
    def step(self, data: tuple[Tensor, Tensor] | None = None,  # type: ignore[override]
             closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        if data is None:
            raise ValueError("NaturalGradient.step needs the minibatch: call opt.step((x, y))")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        params = group["params"]
        if any(p.grad is None for p in params):
            raise ValueError("every parameter needs a gradient before NaturalGradient.step (call backward)")
        g = self.layout.flatten([p.grad for p in params])
        with torch.enable_grad():
            F = self.fisher(data)
        direction, self.last_kappa = damped_direction(F, g, group["alpha"], group["epsilon"])
        steps = self.layout.unflatten(direction.to(g.dtype))
        mu = group["momentum"]
        for p, s in zip(params, steps):
            if mu != 0:
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = s.clone()
                else:
                    st["momentum_buffer"].mul_(mu).add_(s)
                s = s.add(st["momentum_buffer"], alpha=mu) if group["nesterov"] else st["momentum_buffer"]
            p.add_(s, alpha=-group["lr"])
        return loss
