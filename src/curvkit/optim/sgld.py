"""SGLD as a ``torch.optim`` optimiser (devinterp's convention, which the NGD paper's authors used).

One ``step()`` after ``loss.backward()`` (loss = the *mean* minibatch loss) performs, per parameter,

    w <- w - (lr/2) (nbeta ∇ℓ(w) + localization (w - w*)) + noise_level sqrt(lr) ξ,   ξ ~ N(0, I),

which samples exp(-nβ L(w) - (γ/2)||w - w*||²) (paper eq. 20-21 with the minibatch mean restored).
w* is the value of each parameter when the optimiser is built (stored in its state, so it is saved
and restored with ``state_dict``). Noise comes from ``generator`` when given (seeded runs).

For many chains at once use :func:`curvkit.slt.estimate_llc`, which vectorises chains; this class is
the drop-in, one-chain-per-model form (and the sequential baseline in ``benchmarks/llc.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from curvkit.optim.base import CurvatureOptimizer, GroupChecks, check_step_extras
from curvkit.validation import nonnegative, positive


class SGLD(CurvatureOptimizer):
    """Stochastic-gradient Langevin dynamics with localization (lr = ε, nbeta = nβ, localization = γ)."""

    group_checks: ClassVar[GroupChecks] = {"lr": positive, "nbeta": positive, "localization": nonnegative, "noise_level": nonnegative}

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, nbeta: float = 1.0, localization: float = 0.0,
                 noise_level: float = 1.0, generator: torch.Generator | None = None):
        positive("lr (step size epsilon)", lr)
        positive("nbeta", nbeta)
        nonnegative("localization (gamma)", localization)
        nonnegative("noise_level", noise_level)
        super().__init__(params, dict(lr=lr, nbeta=nbeta, localization=localization, noise_level=noise_level))
        self.generator = generator
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["anchor"] = p.detach().clone()

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None, **extras: Any) -> Tensor | None:  # type: ignore[override]
        check_step_extras(type(self).__name__, extras, ())
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, nbeta, gamma = group["lr"], group["nbeta"], group["localization"]
            for p in group["params"]:
                if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                    raise FloatingPointError(
                        f"SGLD got a NaN/inf gradient (lr={lr:g}, nbeta={nbeta:g}, localization={gamma:g}); "
                        "the chain diverged: reduce lr or increase localization. Nothing was changed")
        for group in self.param_groups:
            lr, nbeta, gamma = group["lr"], group["nbeta"], group["localization"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                anchor = self.state[p]["anchor"]
                drift = (p - anchor).mul_(gamma).add_(p.grad, alpha=nbeta)  # nβ g + γ (w - w*)
                gen_dev = self.generator.device if self.generator is not None else p.device
                noise = torch.randn(p.shape, generator=self.generator, dtype=p.dtype, device=gen_dev)
                p.add_(drift, alpha=-0.5 * lr).add_(noise.to(p.device), alpha=group["noise_level"] * math.sqrt(lr))
        return loss
