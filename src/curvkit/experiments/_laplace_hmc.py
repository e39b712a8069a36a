"""Hamiltonian Monte Carlo (Neal 2011) for the ground truth of ``laplace-regression`` (thesis Fig. 5.1).

:func:`hmc` samples a density ``exp(log_prob(theta))`` over a flat vector with the leapfrog integrator and a
Metropolis correction; during burn-in the step size is adapted by dual averaging (Hoffman & Gelman 2014,
Sec. 3.2) towards ``target_accept``, then frozen. The number of leapfrog steps per proposal is drawn
uniformly from [1, max_leapfrog] (jitter avoids periodic orbits). Tested on Gaussian targets
(``tests/test_laplace_hmc.py``): sample mean and covariance match the target's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class HMCResult:
    samples: Tensor  # (num_samples, d)
    accept_rate: float
    step_size: float


def _autograd(log_prob: Callable[[Tensor], Tensor], theta: Tensor) -> tuple[Tensor, Tensor]:
    x = theta.detach().requires_grad_(True)
    lp = log_prob(x)
    (g,) = torch.autograd.grad(lp, x)
    return lp.detach(), g.detach()


def hmc(log_prob: Callable[[Tensor], Tensor], init: Tensor, num_samples: int, burn_in: int = 1000,
        step_size: float = 0.01, max_leapfrog: int = 30, target_accept: float = 0.8, thin: int = 1,
        generator: torch.Generator | None = None,
        value_and_grad: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None) -> HMCResult:
    """``num_samples`` draws (after ``burn_in`` adaptation steps, keeping every ``thin``-th). The gradient of
    ``log_prob`` comes from autograd unless ``value_and_grad(theta) -> (log_prob, gradient)`` is given."""
    theta = init.detach().clone()

    def _grad(_: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
        return value_and_grad(x) if value_and_grad is not None else _autograd(log_prob, x)

    lp, g = _grad(log_prob, theta)
    if not bool(torch.isfinite(lp)):
        raise ValueError("log_prob is not finite at the initial point")
    eps, log_eps_bar, h_bar, mu = step_size, 0.0, 0.0, math.log(10 * step_size)
    out, accepted, total = [], 0, 0
    for it in range(burn_in + num_samples * thin):
        p = torch.randn(theta.shape, dtype=theta.dtype, generator=generator)
        L = int(torch.randint(1, max_leapfrog + 1, (1,), generator=generator))
        th, gr, mom = theta.clone(), g.clone(), p + 0.5 * eps * g
        ok = True
        for step in range(L):
            th = th + eps * mom
            lp_new, gr = _grad(log_prob, th)
            if not bool(torch.isfinite(lp_new)):
                ok = False
                break
            mom = mom + (eps if step < L - 1 else 0.5 * eps) * gr
        if ok:
            log_ratio = float(lp_new - lp - 0.5 * (mom @ mom) + 0.5 * (p @ p))
            a = min(1.0, math.exp(min(0.0, log_ratio))) if math.isfinite(log_ratio) else 0.0
        else:
            a = 0.0
        if ok and float(torch.rand((), generator=generator)) < a:
            theta, lp, g = th, lp_new, gr
            if it >= burn_in:
                accepted += 1
        if it < burn_in:  # dual averaging of log(step size)
            m = it + 1
            h_bar = (1 - 1 / (m + 10)) * h_bar + (target_accept - a) / (m + 10)
            log_eps = mu - math.sqrt(m) / 0.05 * h_bar
            eps = math.exp(log_eps)
            w = m ** -0.75
            log_eps_bar = w * log_eps + (1 - w) * log_eps_bar
            if it == burn_in - 1:
                eps = math.exp(log_eps_bar)
        else:
            total += 1
            if (it - burn_in) % thin == 0:
                out.append(theta.clone())
    return HMCResult(torch.stack(out), accepted / max(total, 1), eps)
