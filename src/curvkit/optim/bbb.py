"""Bayes-by-Backprop SGD (MESU paper Eq. 2; Blundell et al. 2015 without the KL term, raw sigma):

    mu_{n+1} = mu_n - lr * dC/dmu_n ;     sigma_{n+1} = sigma_n - lr * dC/dsigma_n

with the MC gradients of Eq. 1. The paper uses it only as motivation (it is not benchmarked). sigma may
cross zero; sampling uses sigma as is (only |sigma| matters for w = mu + sigma*eps). Its only Hessian
estimate is Lemma 1, ``curvature(method='stein')`` = g_sigma / sigma (Eq. 11).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn
from typing_extensions import Unpack

from curvkit.linalg.operator import DiagonalOperator
from curvkit.optim.meanfield import MeanFieldOptimizer, MeanFieldOptions


class BBBSGD(MeanFieldOptimizer):
    """Plain SGD on (mu, sigma) of a mean-field Gaussian (Eq. 2): ``BBBSGD(model.parameters(), model=model,
    lr=...)``. ``lr`` is required (the paper gives no value); ``sigma_init`` defaults to 0.04. Other
    arguments as in :class:`curvkit.optim.MESU`."""

    POSITIVE = ("lr",)

    def __init__(
        self,
        params: Iterable[Any] | None = None,
        *,
        model: nn.Module | None = None,
        lr: float,
        sigma_init: float = 0.04,
        **options: Unpack[MeanFieldOptions],
    ):
        defaults = dict(lr=lr, sigma_init=sigma_init)
        super().__init__(params, defaults, model=model, **options)

    def _deltas(self, group: dict[str, Any], sigma: Tensor, g_mu: Tensor, g_sigma: Tensor) -> tuple[Tensor, Tensor]:
        return -group["lr"] * g_mu, sigma - group["lr"] * g_sigma

    def curvature(self, method: str = "stein", debias: bool = False) -> DiagonalOperator:
        """Lemma 1 estimate g_sigma / sigma of the last step (the only one for this rule)."""
        if method != "stein":
            raise ValueError("BBBSGD only has the Lemma 1 estimate: use method='stein'")
        return super().curvature("stein")
