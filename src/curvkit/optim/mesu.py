"""MESU - Metaplasticity from Synaptic Uncertainty (Bonnet et al. 2023, "Bayesian Metaplasticity from
Synaptic Uncertainty"), and its variant without the regularisation term (Theorem 2 rule).

MESU (paper Eq. 3; both lines use the pre-step sigma_n and the same MC gradients, Eq. 1):

    mu_{n+1}    = mu_n    - sigma_n^2 * dC/dmu_n
    sigma_{n+1} = sigma_n - sigma_n^2 * dC/dsigma_n + sigma_n (sigma_prior^2 - sigma_n^2) / sigma_res^2

No global learning rate: sigma_n^2 is each weight's learning rate. At stationarity (Theorem 1, Eq. 8; with
constant curvature H this is the exact fixed point of the deterministic recursion Eq. 6, not only the
first-order result of the paper's proof) sigma^2 = (sigma_prior^2/sigma_res^2) / (H + 1/sigma_res^2), so the
mu step is a diagonal Newton step with learning rate sigma_prior^2/sigma_res^2 and damping 1/sigma_res^2. The
Hessian-diagonal estimate read off sigma is Eq. 7:

    H_MESU = sigma_prior^2 / (sigma_res^2 sigma_n^2) - 1 / sigma_res^2.

MESU w/o reg (:class:`MESUNoReg`, Theorem 2): the same rule without the last term; sigma_n^2 -> 1/(2 n H)
("vanishing plasticity", Eq. 10) and the estimate is Eq. 9, H_noreg = 1/(2 n sigma_n^2), which carries the
floor 1/(2 n sigma_0^2) (derived, not in the paper: 1/(2 n sigma_n^2) ~ H + 1/(2 n sigma_0^2); 5e-4 at
n = 1e5, sigma_0 = 0.1, which is the threshold the paper reports for Fig. 2c).

Defaults are the paper's permuted-MNIST benchmark setting (Appendix D): sigma_prior = sigma_init = 0.04,
sigma_res = 10; K = 10 MC samples (the paper does not give K; 10 is Zeno et al.'s BGD setting for this
benchmark); loss = minibatch *sum* of the NLL (the paper does not state the reduction; the sum follows Zeno
et al.'s BGD code and the MESU authors' later code). The Fig. 2a-c theory check uses
sigma_prior = sigma_init = 0.1.

Stability: a step is only safe while the per-step curvature h of a weight stays below 1/sigma^2
(sigma * g_sigma ~ sigma^2 h < 1; derived from Eq. 6, not stated in the paper). With a sum-reduced loss h
grows with the batch size: on an SGD-pretrained 784-100-10 MNIST net with sigma = 0.1 and batch 100 the sum
loss violates it from the first step and MESU / MESU w/o reg / BGD all diverge (measured; the ``mesu-hessian``
experiment therefore uses the batch mean). Watch ``opt.diagnostics`` (``steps_large_sigma_grad``,
``sigma_sign_flips``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn
from typing_extensions import Unpack

from curvkit.optim.meanfield import MeanFieldOptimizer, MeanFieldOptions


class MESU(MeanFieldOptimizer):
    """MESU optimiser (Eq. 3): ``MESU(model.parameters(), model=model)``, then ``opt.step(batch=(X, y))``.

    **The loss must be the minibatch SUM of the per-example NLL** (the default ``loss_fn`` is
    ``CrossEntropy(reduction='sum')``): there is no learning rate, and a batch mean makes every step B
    times smaller (a :class:`~curvkit.optim.meanfield.MeanReductionWarning` says so when the loss declares
    a mean reduction). torch.optim-compatible (param groups, ``state_dict``, ``step(closure)``).

    Args:
        params: the Bayesian parameters or param groups (default: all trainable parameters of ``model``;
            frozen parameters, ``requires_grad=False``, are left out and never change); groups may override ``sigma_prior``, ``sigma_res``, ``sigma_init``, ``sigma_min``, ``max_ratio``.
        model: module whose parameters are the means mu (updated in place); required.
        sigma_prior: sigma_p > 0, the value sigma is pulled toward (default 0.04).
        sigma_res: sigma_res > 0, sets the strength of the pull, 1/sigma_res^2 (default 10).
        sigma_init: sigma_0 > 0 of every weight (default: the group's ``sigma_prior``, as in all paper
            experiments).
        mc_samples: K >= 1 Monte Carlo samples per step (default 10).
        loss_fn: minibatch loss of one weight sample (default ``CrossEntropy(reduction='sum')``).
        regularize: False gives the Theorem 2 rule (prefer :class:`MESUNoReg`).
        sigma_min, max_ratio: optional safeguards (default off; see :mod:`curvkit.optim.meanfield`).
        seed, generator, chunk_size: noise generator and vmap chunking.
        distributed: a :class:`curvkit.distributed.Reducer` for data-parallel steps (see
            :class:`curvkit.optim.meanfield.MeanFieldOptimizer`).

    Use: ``loss = opt.step(batch=(X, y))`` (vectorised over the K samples) or ``opt.step(closure)``.
    ``opt.curvature()`` returns Eq. 7 (or Eq. 9 with ``regularize=False``) as a DiagonalOperator.

    Derived constants (from Eqs. 6 and 8, not stated in the paper): Newton learning rate
    sigma_p^2/sigma_res^2, relaxation time of sigma tau = sigma_res^2/(2 sigma_p^2) steps
    (:meth:`relaxation_time`), memory window sigma_res^2/sigma_p^2 (the N of the authors' follow-up paper,
    which writes sigma_res^2 = N sigma_prior^2).
    """

    def __init__(
        self,
        params: Iterable[Any] | None = None,
        *,
        model: nn.Module | None = None,
        sigma_prior: float = 0.04,
        sigma_res: float = 10.0,
        sigma_init: float | None = None,
        regularize: bool = True,
        **options: Unpack[MeanFieldOptions],
    ):
        self.regularize = bool(regularize)
        defaults = dict(
            sigma_prior=sigma_prior,
            sigma_res=sigma_res,
            sigma_init=sigma_init,  # None: the group's sigma_prior
        )
        super().__init__(params, defaults, model=model, **options)

    POSITIVE = ("sigma_prior", "sigma_res")

    def _check_group(self, group: dict[str, Any]) -> None:
        if group["sigma_init"] is None:
            group["sigma_init"] = group["sigma_prior"]

    def relaxation_time(self, group: int = 0) -> float:
        """tau = sigma_res^2 / (2 sigma_prior^2) steps; inf without regularisation.

        Derived from Eq. 6 (not in the paper): near the fixed point sigma contracts by
        1 - 2 sigma_prior^2/sigma_res^2 per step, whatever the curvature."""
        g = self.param_groups[group]
        return g["sigma_res"] ** 2 / (2 * g["sigma_prior"] ** 2) if self.regularize else math.inf

    def _deltas(self, group: dict[str, Any], sigma: Tensor, g_mu: Tensor, g_sigma: Tensor) -> tuple[Tensor, Tensor]:
        s2 = sigma * sigma
        d_mu = -s2 * g_mu
        new_sigma = sigma - s2 * g_sigma
        if self.regularize:
            new_sigma = new_sigma + sigma * (group["sigma_prior"] ** 2 - s2) / group["sigma_res"] ** 2
        return d_mu, new_sigma

    def _state_hessian(self, group: dict[str, Any], sigma: Tensor, debias: bool) -> Tensor:
        n = self.num_steps
        u = 1.0 / sigma**2
        u0 = 1.0 / float(group["sigma_init"]) ** 2
        if not self.regularize:
            # Eq. 9: 1/(2 n sigma^2); debiased: (u_n - u_0)/(2n) removes the 1/(2 n sigma_0^2) floor.
            return (u - u0) / (2 * n) if debias else u / (2 * n)
        sp2, sr2 = float(group["sigma_prior"]) ** 2, float(group["sigma_res"]) ** 2
        if debias:
            # leaky integrator u_n = u_inf + (u_0 - u_inf) rho^n, rho = 1 - 2 sp2/sr2 (u = 1/sigma^2 under
            # Eq. 6 with constant H; derived, not in the paper)
            rho_n = (1.0 - 2.0 * sp2 / sr2) ** n
            u = (u - u0 * rho_n) / (1.0 - rho_n)
        return sp2 * u / sr2 - 1.0 / sr2  # Eq. 7


class MESUNoReg(MESU):
    """MESU without the regularisation term (Theorem 2 rule, Fig. 2c "MESU w/o reg"):

        mu_{n+1} = mu_n - sigma_n^2 dC/dmu_n ;   sigma_{n+1} = sigma_n - sigma_n^2 dC/dsigma_n.

    ``sigma_prior``/``sigma_res`` are unused; ``sigma_init`` defaults to 0.1 (the Fig. 2c value).
    ``curvature()`` is Eq. 9, 1/(2 n sigma_n^2). Equals BGD's rule to first order in sigma*g_sigma
    up to a factor 0.5 on the sigma step (see :class:`curvkit.optim.BGD`).
    """

    def __init__(self, params: Iterable[Any] | None = None, *, model: nn.Module | None = None,
                 sigma_init: float = 0.1, **kwargs: Any):
        if "regularize" in kwargs:
            raise TypeError("MESUNoReg has no 'regularize' argument (it is MESU with regularize=False)")
        super().__init__(params, model=model, sigma_init=sigma_init, regularize=False, **kwargs)
