"""Factorised filters with a momentum latent: Bayesian Adam (Aitchison 2018, Sec. 2.1.2, Eqs. 15-21,
and SI Sec. 4.2).

Per weight the latent is z = (w, p) with the prior dynamics (15)-(16)

    p(t+1) = (1 - eta_p) p(t) + eta_p xi_p,   w(t+1) = (1 - a) w(t) + eta p(t) + eta_w xi_w,
    a = (eta^2 + eta_w^2) / (2 sigma^2),      F = I - A = [[1 - a, eta], [0, 1 - eta_p]],  Q = diag(eta_w^2, eta_p^2).

The likelihood only sees w (Eq. 17: e = (e, 0)). Adam's hyperparameters map as lr = eta and
beta1 = 1 - eta_p. The gradient is taken at the predicted mean mu_w^- = (1-a) mu_w + eta mu_p, which is
Nesterov acceleration with "Nesterov-accelerated weight decay" (Sec. 2.2.4).

* :class:`BFAdam` (Eqs. 15-17 in the generic updates, Eqs. 3, 4 and 7): the exact 2x2 Kalman filter per
  weight (predict P = F Sigma F^T + Q, then
      k = 1/(1 + P_ww e^2), Sigma_ww = P_ww k, Sigma_wp = P_wp k, Sigma_pp = P_pp - P_wp^2 e^2 k,
      mu_w = mu_w^- + Sigma_ww g, mu_p = mu_p^- + Sigma_wp g).
  Its effective Adam learning rate is about 0.7-0.83 eta at eta_p = 0.1, not eta (measured on the exact filter
  with a constant gradient; the paper's closed forms, Eq. 21 and the Sigma_ww equation after it, are only
  rough approximations of its steady state).
* :class:`BFAdamSS` (Eqs. 18-21 and the unnumbered Sigma_ww equation after Eq. 21): the steady state with
  v = EMA(e^2) (the paper only writes an average <e^2>; an Adam-style EMA is the choice made here):
      Sigma_wp = eta_p / sqrt(v_hat),  Sigma_ww = 0 (Adam)  or  sqrt((eta_w^2 + 2 eta Sigma_wp)/v_hat)
      (``combine=True``, Sec. 2.2.7). With Sigma_ww = 0 the displacement at step t+1 is eta mu_p(t),
      with mu_p an EMA (weight eta_p) of g / sqrt(v_hat): Adam without bias correction of the first
      moment, lagged by one step (derived, not stated in the paper, which substitutes the steady mu_p into
      Eq. 18a, printed there as "Eq. 18b"; checked step by step in the tests).

Only the paper's first-order discretisation of the drift is used here (the scalar filters default to the exact
exponential discretisation of the author's later code, which keeps the stationary variance exactly sigma^2;
the 2x2 model keeps the paper's F so that the exact discrete Lyapunov and Riccati solutions in :mod:`.mapping`
describe it verbatim).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from curvkit.curvature.config import renamed_option
from curvkit.optim.filters._base import (
    Reduction,
    check_positive,
    check_unit_interval,
    stationary_variance,
)
from curvkit.optim.filters.factorised import _Factorised


def _decay(group: dict[str, Any]) -> float:
    s2 = group["sigma2"]
    return 1.0 if math.isinf(s2) else 1.0 - (group["lr"] ** 2 + group["eta_w"] ** 2) / (2.0 * s2)


def _prior_mean(p: Tensor, mu_w: Tensor, decay: float, mu_p: Tensor, eta: float) -> None:
    """p = (1 - a) mu_w + eta mu_p: the predicted mean where the next gradient is taken (Nesterov + NAWD)."""
    if decay == 1.0:
        p.copy_(mu_w)
    else:
        torch.mul(mu_w, decay, out=p)
    p.add_(mu_p, alpha=eta)


class BFAdam(_Factorised):
    """Bayesian-filtering Adam: exact per-weight weight+momentum Kalman filter (Sec. 2.1.2, Eqs. 15-17).

    Args: ``lr`` = eta (momentum coupling; Adam lr), ``eta_p`` = 1 - beta1, ``eta_w`` direct diffusion
    of w (0 = pure Adam model), ``sigma2`` stationary prior variance (inf: no decay), ``s0`` initial
    Sigma_ww (default: sigma^2's stationary value, or ``lr_sgd / B`` when sigma^2 = inf).
    Initial covariance: the stationary prior of (15)-(16) (SI Sec. 4.2; the paper gives no initialisation,
    this is the choice made here), Sigma_wp and Sigma_pp from the exact discrete Lyapunov equation
    (Sigma_pp = eta_p/(2 - eta_p)).
    """

    _var_key = "S_ww"

    def __init__(self, params: Any, lr: float = 1e-3, eta_p: float = 0.1, eta_w: float = 0.0,
                 sigma2: float = math.inf, s0: float | None = None, lr_sgd: float = 0.1,
                 curvature: str = "empirical", reduction: Reduction = "mean", batch_size: int | None = None,
                 fisher: str | None = None):
        fisher = renamed_option(curvature, fisher, type(self).__name__, "curvature", "fisher", "empirical")
        check_positive("lr", lr)
        check_unit_interval("eta_p", eta_p)
        check_positive("eta_w", eta_w, allow_zero=True)
        check_positive("sigma2", sigma2, allow_inf=True)
        check_positive("lr_sgd", lr_sgd)
        s_cap = stationary_variance(math.inf, s0, lr_sgd, batch_size or 1) if (s0 is not None or math.isinf(sigma2)) \
            else None
        super().__init__(params, {"lr": lr, "eta_p": eta_p, "eta_w": eta_w, "sigma2": float(sigma2),
                                  "s0": s_cap}, fisher, reduction, batch_size, drift="paper")

    def _init_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        eta, eta_p, eta_w = group["lr"], group["eta_p"], group["eta_w"]
        a = 1.0 - _decay(group)
        pp = eta_p / (2.0 - eta_p)
        wp = eta * (1 - eta_p) * pp / (1 - (1 - a) * (1 - eta_p))
        if group["s0"] is not None:
            ww = group["s0"]
        else:
            ww = (2 * (1 - a) * eta * wp + eta**2 * pp + eta_w**2) / (1 - (1 - a) ** 2)
        state["s0"] = ww
        state["S_ww"] = torch.full_like(p, ww)
        state["S_wp"] = torch.full_like(p, wp)
        state["S_pp"] = torch.full_like(p, pp)
        state["mu_post"] = p.detach().clone()
        state["mu_p"] = torch.zeros_like(p)

    def _update(self, p: Tensor, g: Tensor, e2: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        eta, eta_p, eta_w = group["lr"], group["eta_p"], group["eta_w"]
        d = _decay(group)
        q = 1.0 - eta_p
        Sww, Swp, Spp = state["S_ww"], state["S_wp"], state["S_pp"]
        # predict covariance P = F Sigma F^T + Q  (Eq. 3b with (16)), in place: Sww <- P_ww, Spp <- P_pp
        Pwp = torch.mul(Swp, d * q).add_(Spp, alpha=eta * q)
        if d != 1.0:
            Sww.mul_(d * d)
        Sww.add_(Swp, alpha=2 * d * eta).add_(Spp, alpha=eta * eta)
        if eta_w:
            Sww.add_(eta_w * eta_w)
        Spp.mul_(q * q).add_(eta_p * eta_p)
        # rank-1 update with e = (e, 0)  (Eq. 7): k = 1/(1 + P_ww e^2)
        den = torch.mul(Sww, e2).add_(1.0)
        Sww.div_(den)                                   # Sigma_ww = P_ww k
        torch.div(Pwp, den, out=Swp)                    # Sigma_wp = P_wp k
        Spp.addcmul_(Pwp.mul_(e2), Swp, value=-1.0)     # Sigma_pp = P_pp - P_wp^2 e^2 k
        # means: parameters hold mu_w^- ; mu_p^- = (1 - eta_p) mu_p
        mu_w, mu_p = state["mu_post"], state["mu_p"]
        torch.addcmul(p, Sww, g, out=mu_w)
        mu_p.mul_(q).addcmul_(Swp, g)
        _prior_mean(p, mu_w, d, mu_p, eta)              # mu_w^- of the next step

    def _step_gain(self, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        # steady displacement per unit gradient: Sigma_ww + eta Sigma_wp / eta_p (Eqs. 18a-b with mu_p at its
        # steady value Sigma_wp g / eta_p)
        return state["S_ww"] + state["S_wp"] * (group["lr"] / group["eta_p"])


class BFAdamSS(_Factorised):
    """Steady-state Bayesian Adam (Eqs. 18-21); ``combine=True`` keeps Sigma_ww (RMSProp+Adam, Sec. 2.2.7).

    ``posterior_precision`` is the diagonal 1/Sigma_ww; with ``combine=False`` (Sigma_ww = 0, the paper's
    "questionable approximation") it is reported from the combined formula with eta_w as given, so it
    stays finite: sqrt(v_hat / (eta_w^2 + 2 eta Sigma_wp)).
    """

    def __init__(self, params: Any, lr: float = 1e-3, eta_p: float = 0.1, eta_w: float = 0.0,
                 sigma2: float = math.inf, beta2: float = 0.999, eps: float = 1e-8,
                 bias_correction: bool = True, combine: bool = False, curvature: str = "empirical",
                 reduction: Reduction = "mean", batch_size: int | None = None, lr_sgd: float = 0.1,
                 fisher: str | None = None):
        fisher = renamed_option(curvature, fisher, type(self).__name__, "curvature", "fisher", "empirical")
        check_positive("lr", lr)
        check_unit_interval("eta_p", eta_p)
        check_positive("eta_w", eta_w, allow_zero=True)
        check_positive("sigma2", sigma2, allow_inf=True)
        check_unit_interval("beta2", beta2)
        check_positive("eps", eps, allow_zero=True)
        s_cap = stationary_variance(sigma2, None, lr_sgd, batch_size or 1)
        super().__init__(params, {"lr": lr, "eta_p": eta_p, "eta_w": eta_w, "sigma2": float(sigma2),
                                  "beta2": beta2, "eps": eps, "bias_correction": bias_correction,
                                  "combine": combine, "s0": s_cap}, fisher, reduction, batch_size,
                         drift="paper")

    def _init_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["v"] = torch.zeros_like(p)
        state["mu_p"] = torch.zeros_like(p)
        state["mu_post"] = p.detach().clone()
        state["s0"] = group["s0"]

    def _root_vhat(self, state: dict[str, Any], group: dict[str, Any]) -> tuple[Tensor, float]:
        """(sqrt(v + eps bc), sqrt(bc)), so that sqrt(v_hat + eps) = sqrt(v + eps bc) / sqrt(bc); one allocation."""
        bc = 1.0 - group["beta2"] ** state["step"] if group["bias_correction"] else 1.0
        return torch.add(state["v"], group["eps"] * bc).sqrt_(), math.sqrt(bc)

    def _gains(self, state: dict[str, Any], group: dict[str, Any], combine: bool) -> tuple[Tensor, Tensor]:
        """(Sigma_ww, Sigma_wp): Sigma_wp = eta_p/sqrt(v_hat), Sigma_ww = 0 or sqrt((eta_w^2 + 2 eta Sigma_wp)/v_hat)."""
        root, rbc = self._root_vhat(state, group)
        Swp = root.reciprocal_().mul_(group["eta_p"] * rbc)
        if not combine:
            return torch.zeros_like(Swp), Swp
        inv_vhat = (Swp / group["eta_p"]).square_()
        return inv_vhat.mul_(Swp * (2 * group["lr"]) + group["eta_w"] ** 2).sqrt_(), Swp

    def _update(self, p: Tensor, g: Tensor, e2: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        check_positive("lr", group["lr"])
        state["v"].mul_(group["beta2"]).add_(e2, alpha=1 - group["beta2"])
        mu_w, mu_p = state["mu_post"], state["mu_p"]
        if group["combine"]:
            Sww, Swp = self._gains(state, group, True)
            mu_p.mul_(1 - group["eta_p"]).addcmul_(Swp, g)
            torch.addcmul(p, Sww, g, out=mu_w)
        else:                                               # Sigma_ww = 0: mu_post = mu_prior
            root, rbc = self._root_vhat(state, group)
            mu_p.mul_(1 - group["eta_p"]).addcdiv_(g, root, value=group["eta_p"] * rbc)   # EMA(g / sqrt(v_hat))
            mu_w.copy_(p)
        _prior_mean(p, mu_w, _decay(group), mu_p, group["lr"])

    def _posterior_var(self, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        return self._gains(state, group, True)[0]

    def _step_gain(self, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        Sww, Swp = self._gains(state, group, group["combine"])
        return Sww + Swp * (group["lr"] / group["eta_p"])
