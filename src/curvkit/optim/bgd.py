"""BGD - Bayesian Gradient Descent (Zeno, Golan, Hoffer & Soudry 2018), the exact rule of Zeno et al.'s
reference code (the MESU paper only states it approximately, see below), with the same MC gradient estimates
as MESU (MESU paper Eq. 1; sum-reduced loss, as Zeno's code multiplies mean gradients by the batch size):

    mu    <- mu - eta * sigma^2 * g_mu
    sigma <- sigma * sqrt(1 + (sigma * g_sigma / 2)^2) - sigma^2 * g_sigma / 2

To first order in sigma*g_sigma the sigma step is sigma - sigma^2 g_sigma / 2, i.e. MESU without the
regularisation term with a factor 0.5 on the sigma update (MESU paper Sec. 2, "Importance of the
regularization term", valid when sigma g_sigma << 1); sigma stays positive because
sigma sqrt(1 + x^2) > sigma x. With constant curvature H, sigma_n^2 ~ 1/(n H) (derived here as in the paper's
Theorem 2, whose rule without the factor 0.5 gives 1/(2 n H), Eq. 10), so the Hessian-diagonal estimate read
off sigma is

    H_BGD = 1 / (n sigma_n^2)          (floor 1/(n sigma_0^2); ``debias=True`` removes it)

Defaults: eta = 1, K = 10 (Zeno's settings), sigma_init = 0.04 (MESU paper Appendix D, permuted MNIST).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from curvkit.optim.meanfield import MeanFieldOptimizer, MeanFieldOptions


class BGD(MeanFieldOptimizer):
    """Bayesian Gradient Descent: ``BGD(model.parameters(), model=model)``. torch.optim-compatible; per-group
    ``eta``, ``sigma_init``, ``sigma_min``, ``max_ratio``. See :class:`curvkit.optim.MESU` for the arguments
    shared by all mean-field optimisers (the loss must be SUMMED over the minibatch) and the module
    docstring for the rule."""

    POSITIVE = ("eta",)

    def __init__(
        self,
        params: Iterable[Any] | None = None,
        *,
        model: nn.Module | None = None,
        eta: float = 1.0,
        sigma_init: float = 0.04,
        **options: Unpack[MeanFieldOptions],
    ):
        defaults = dict(eta=eta, sigma_init=sigma_init)
        super().__init__(params, defaults, model=model, **options)

    def _deltas(self, group: dict[str, Any], sigma: Tensor, g_mu: Tensor, g_sigma: Tensor) -> tuple[Tensor, Tensor]:
        d_mu = -group["eta"] * sigma * sigma * g_mu
        half = sigma * g_sigma / 2
        new_sigma = sigma * torch.sqrt(1 + half * half) - sigma * half
        return d_mu, new_sigma

    def _state_hessian(self, group: dict[str, Any], sigma: Tensor, debias: bool) -> Tensor:
        n = self.num_steps
        u = 1.0 / sigma**2
        if debias:
            u = u - 1.0 / float(group["sigma_init"]) ** 2
        return u / n
