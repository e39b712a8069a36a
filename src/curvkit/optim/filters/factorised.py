"""Factorised (one scalar filter per weight) Bayesian-filtering optimisers without momentum
(Aitchison 2018, Sec. 2.1.1 and SI Sec. 4.1).

Per weight, with g the ascent gradient of the summed log-likelihood at the current parameters
(mu_prior) and e^2 a Fisher sample (see ``fisher`` modes in :mod:`._base`):

* :class:`BFNatGrad` (Eqs. 13-14, eta = 0):   s <- s / (1 + s e^2);   mu <- mu + s g.
  s(T) = (1/s0 + sum_t e^2(t))^{-1}: a mean-square normaliser with 1/t step sizes.
* :class:`BFRMSProp` (Eqs. 8-12, exact scalar Kalman filter with drift A = eta^2/(2 sigma^2), Q = eta^2):
      s_prior = (1-a)^2 s + eta^2         (paper form)  or  s e^{-eta^2/sigma^2} + sigma^2 (1 - e^{-eta^2/sigma^2})
      s = 1 / (1/s_prior + e^2)            (12)  -- normaliser updated before the step (Sec. 2.2.5)
      mu_post = mu_prior + s g             (10)
      mu_prior(next) = (1-a) mu_post       (9)  -- decoupled weight decay, applied before the next forward
  Steady state s -> eta/sqrt(<e^2>) (RMSProp with lr eta) when sigma^2 = inf and eta sqrt(<e^2>) << 1.
* :class:`BFRMSPropSS` (the steady state after Eq. 14, extended to a finite sigma^2): s from the fixed point
  with a running v ~ <e^2>,
      1/s = 1/(2 sigma^2) + sqrt(1/(4 sigma^4) + (v_hat + eps)/eta^2)   (sigma^2 = inf: s = eta/sqrt(v_hat + eps)).
  With sigma^2 = inf, curvature='empirical', bias_correction=False, eps=0 it is torch RMSprop(lr=eta, alpha=beta2, eps=0).

Hyperparameter names: ``lr`` is eta (the steady-state Adam/RMSProp learning rate; a torch LR scheduler
may change it), ``sigma2`` the stationary prior variance (``inf``: no decay; AdamW mapping in
:mod:`.mapping`), ``s0`` the initial posterior variance (default sigma^2 if finite, else ``lr_sgd / B``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from curvkit.curvature.config import renamed_option
from curvkit.optim.base import GroupChecks, check_step_extras
from curvkit.optim.filters._base import (
    FilterOptimizer,
    Reduction,
    ascent_grad,
    check_fisher_mode,
    check_positive,
    check_unit_interval,
    fisher_square,
    split_given,
    stationary_variance,
)


def drift_coefficients(eta: float, sigma2: float, form: str) -> tuple[float, float, float]:
    """(mean decay, variance multiplier, additive variance) of one prior step.

    ``form='paper'``: Eqs. 9 and 11. ``form='exp'``: the exact discretisation of the same drift, used by the
    author's later code, which keeps the stationary variance exactly sigma^2; the two agree to
    O(eta^4/sigma^4)."""
    if math.isinf(sigma2):
        return 1.0, 1.0, eta * eta
    if form == "exp":
        r = math.exp(-(eta * eta) / sigma2)
        return math.sqrt(r), r, sigma2 * (1.0 - r)
    a = eta * eta / (2.0 * sigma2)
    return 1.0 - a, (1.0 - a) ** 2, eta * eta


class _Factorised(FilterOptimizer):
    """Shared step loop. Subclasses implement ``_update`` and set ``_var_key`` (posterior variance)."""

    _var_key = "s"
    group_checks: ClassVar[GroupChecks] = {"lr": check_positive, "sigma2": lambda n, v: check_positive(n, v, allow_inf=True),
                    "s0": check_positive, "beta2": check_unit_interval,
                    "eps": lambda n, v: check_positive(n, v, allow_zero=True), "eta_p": check_unit_interval,
                    "eta_w": lambda n, v: check_positive(n, v, allow_zero=True)}

    def __init__(self, params: Any, defaults: dict[str, Any], fisher: str, reduction: Reduction,
                 batch_size: int | None, drift: str = "exp"):
        check_fisher_mode(fisher)
        if drift not in ("exp", "paper"):
            raise ValueError(f"drift must be 'exp' (exact OU discretisation) or 'paper' (Eq. 11), got {drift!r}")
        defaults = {**defaults, "fisher": fisher, "drift": drift}
        super().__init__(params, defaults, reduction, batch_size)

    def _init_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(self, p: Tensor, g: Tensor, e2: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Any = None, *, fisher_diag: Any = None, batch_size: int | None = None,
             **extras: Any) -> Any:
        """One filtering step. ``fisher_diag``: list (one per parameter, summed-loss units) for fisher='given'."""
        check_step_extras(type(self).__name__, extras, ("fisher_diag", "batch_size"))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = self.loss_scale.factor(batch_size)
        named = list(self._named_params())
        given = split_given(fisher_diag, len(named))
        for (name, p, group), gv in zip(named, given):
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                self._init_state(p, state, group)
            g = ascent_grad(p, scale, name)
            e2 = fisher_square(group["fisher"], g, state, gv, name)
            state["step"] = state.get("step", 0) + 1
            self._update(p, g, e2, state, group)
        return loss

    # ------------------------------------------------------------------ curvature and diagnostics
    def _variances(self) -> list[tuple[str, Tensor, Tensor]]:
        out = []
        for name, p, group in self._named_params():
            st = self.state.get(p, {})
            if not st:
                raise RuntimeError("the optimiser has no posterior yet: call step() first")
            out.append((name, p, self._posterior_var(st, group)))
        return out

    def _posterior_var(self, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        return state[self._var_key]

    def curvature(self) -> Any:
        """Diagonal posterior precision 1/s (summed-log-likelihood units) as a DiagonalOperator."""
        from curvkit.linalg.operator import DiagonalOperator

        return DiagonalOperator(self._layout(), [1.0 / v for _, _, v in self._variances()])

    def _step_gain(self, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        """Displacement of the mean per unit ascent gradient (s, or the momentum filters' steady gain)."""
        return self._posterior_var(state, group)

    def effective_lr(self) -> dict[str, Tensor]:
        """Per-weight effective SGD learning rate on the user's loss: gain * loss scale (gain = s)."""
        scale = self.loss_scale.factor() if self.loss_scale.reduction == "mean" and self.loss_scale.batch_size else 1.0
        out = {}
        for name, p, group in self._named_params():
            st = self.state.get(p, {})
            if st:
                out[name] = self._step_gain(st, group) * scale
        return out

    def _cap(self, state: dict[str, Any], group: dict[str, Any]) -> float:
        """The SGD-like limit of the gain: sigma^2; with sigma^2 = inf the SGD-like warm start s0 of the exact
        filters (BFNatGrad, BFRMSProp, BFAdam), and none (inf) for the steady-state filters, which have no
        SGD-like regime."""
        s2 = group.get("sigma2", math.inf)
        if math.isfinite(s2):
            return s2
        return math.inf if "v" in state else state.get("s0", math.inf)

    def diagnostics(self) -> list[dict[str, Any]]:
        """Per-tensor effective learning rate (statistics over the tensor) and regime (see
        :func:`.mapping.regime`; not in this version of the paper).

        With ``gain`` the displacement of the mean per unit ascent gradient (s; for the momentum filters the
        steady gain Sigma_ww + eta Sigma_wp / eta_p) and ``cap`` = sigma^2, or when sigma^2 = inf the initial
        s0 of the exact filters (their SGD-like warm start lr_sgd / B; the steady-state filters BFRMSPropSS
        and BFAdamSS have no SGD-like regime then and report ``sgd_like`` = 0):

        * ``sgd_like`` = min(gain / cap, 1): 1 in the SGD limit (s at its prior cap);
        * ``adam_like`` = min(gain sqrt(v_hat) / eta, 1) for the filters with a running v (BFRMSPropSS,
          BFAdamSS): 1 in the Adam/RMSProp limit; for the exact filters (BFNatGrad, BFRMSProp, BFAdam) the
          steady-state identity v s^2 = eta^2 (1 - s/sigma^2) gives ``adam_like = sqrt(1 - sgd_like)``; 0 when
          eta = 0 (BFNatGrad).

        Both are medians over the tensor's entries (weights that never receive a gradient, e.g. the input
        weights of always-black MNIST pixels, would dominate a mean); ``regime`` names the larger.
        """
        rows = []
        lrs = self.effective_lr()
        for name, p, group in self._named_params():
            st = self.state.get(p, {})
            if not st or name not in lrs:
                continue
            gain = self._step_gain(st, group)
            sgd = (gain / self._cap(st, group)).clamp(max=1.0)
            eta = group.get("lr", 0.0)
            if "v" in st and eta > 0:
                v = st["v"] / (1 - group["beta2"] ** st["step"]) if group.get("bias_correction") else st["v"]
                adam = (gain * v.sqrt() / eta).clamp(max=1.0)
            elif eta > 0:
                adam = (1 - sgd).clamp(min=0).sqrt()
            else:
                adam = torch.zeros_like(sgd)
            lr = lrs[name]
            sgd_m, adam_m = float(sgd.median()), float(adam.median())
            rows.append({
                "name": name, "lr_mean": float(lr.mean()), "lr_median": float(lr.median()),
                "lr_min": float(lr.min()), "lr_max": float(lr.max()),
                "sgd_like": sgd_m, "adam_like": adam_m, "regime": "sgd" if sgd_m > adam_m else "adam",
            })
        return rows


class BFNatGrad(_Factorised):
    """Factorised natural gradient, static optimum (Eqs. 13-14). ``s0``: initial variance
    (default ``lr_sgd / batch_size``)."""

    def __init__(self, params: Any, s0: float | None = None, lr_sgd: float = 0.1, curvature: str = "empirical",
                 reduction: Reduction = "mean", batch_size: int | None = None,
                 fisher: str | None = None):
        fisher = renamed_option(curvature, fisher, type(self).__name__, "curvature", "fisher", "empirical")
        check_positive("lr_sgd", lr_sgd)
        ls_batch = batch_size or 1
        s_init = stationary_variance(math.inf, s0, lr_sgd, ls_batch)
        super().__init__(params, {"s0": s_init, "sigma2": math.inf}, fisher, reduction, batch_size)

    def _init_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["s"] = torch.full_like(p, group["s0"])
        state["s0"] = group["s0"]

    def _update(self, p: Tensor, g: Tensor, e2: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        s = state["s"]
        s.div_(e2.mul_(s).add_(1.0))               # (14) s / (1 + s e^2); e2 is scratch
        p.addcmul_(s, g)                           # (13)


class BFRMSProp(_Factorised):
    """Bayesian-filtering RMSProp: the exact per-weight Kalman filter with drift (Eqs. 8-12)."""

    def __init__(self, params: Any, lr: float = 1e-3, sigma2: float = math.inf, s0: float | None = None,
                 lr_sgd: float = 0.1, curvature: str = "empirical", drift: str = "exp",
                 reduction: Reduction = "mean", batch_size: int | None = None,
                 fisher: str | None = None):
        fisher = renamed_option(curvature, fisher, type(self).__name__, "curvature", "fisher", "empirical")
        check_positive("lr", lr)
        check_positive("sigma2", sigma2, allow_inf=True)
        check_positive("lr_sgd", lr_sgd)
        s_init = stationary_variance(sigma2, s0, lr_sgd, batch_size or 1)
        super().__init__(params, {"lr": lr, "sigma2": float(sigma2), "s0": s_init}, fisher, reduction,
                         batch_size, drift)

    def _init_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["s"] = torch.full_like(p, group["s0"])
        state["s0"] = group["s0"]

    def _update(self, p: Tensor, g: Tensor, e2: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        check_positive("lr", group["lr"])
        decay, mult, add = drift_coefficients(group["lr"], group["sigma2"], group["drift"])
        s = state["s"]
        if mult != 1.0:
            s.mul_(mult)
        s.add_(add)                                 # (11) predict
        s.div_(e2.mul_(s).add_(1.0))                # (12) update, 1/(1/s + e^2); e2 is scratch
        _step_mean(p, state, decay, s, g)


class BFRMSPropSS(_Factorised):
    """Steady-state Bayesian RMSProp: the fixed point of the filter of Eqs. 8-12 with v = EMA(e^2).

    The paper writes only an average <e^2>; an Adam-style EMA with bias correction is the choice made here,
    and so is ``eps`` (the paper has none: its sigma^2 bounds the step)."""

    def __init__(self, params: Any, lr: float = 1e-3, sigma2: float = math.inf, beta2: float = 0.999,
                 eps: float = 1e-8, bias_correction: bool = True, curvature: str = "empirical",
                 drift: str = "exp", reduction: Reduction = "mean", batch_size: int | None = None,
                 lr_sgd: float = 0.1,
                 fisher: str | None = None):
        fisher = renamed_option(curvature, fisher, type(self).__name__, "curvature", "fisher", "empirical")
        check_positive("lr", lr)
        check_positive("sigma2", sigma2, allow_inf=True)
        check_unit_interval("beta2", beta2)
        check_positive("eps", eps, allow_zero=True)
        s_cap = stationary_variance(sigma2, None, lr_sgd, batch_size or 1)
        super().__init__(params, {"lr": lr, "sigma2": float(sigma2), "beta2": beta2, "eps": eps,
                                  "bias_correction": bias_correction, "s0": s_cap},
                         fisher, reduction, batch_size, drift)

    def _init_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["v"] = torch.zeros_like(p)
        state["s0"] = group["s0"]

    def _posterior_var(self, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        return self._fixed_point(state, group)

    def _fixed_point(self, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        return 1.0 / self._inverse_fixed_point(state, group)

    def _inverse_fixed_point(self, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        """1/s = 1/(2 sigma^2) + sqrt(1/(4 sigma^4) + (v_hat + eps)/eta^2), as a new tensor (one allocation)."""
        eta, s2 = group["lr"], group["sigma2"]
        bc = 1.0 - group["beta2"] ** state["step"] if group["bias_correction"] else 1.0
        c = 0.0 if math.isinf(s2) else 1.0 / (2.0 * s2)
        # (v/bc + eps)/eta^2 + c^2, then sqrt, then + c
        out = torch.mul(state["v"], 1.0 / (bc * eta * eta)).add_(group["eps"] / (eta * eta) + c * c).sqrt_()
        return out.add_(c) if c else out

    def _update(self, p: Tensor, g: Tensor, e2: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        check_positive("lr", group["lr"])
        state["v"].mul_(group["beta2"]).add_(e2, alpha=1 - group["beta2"])
        inv_s = self._inverse_fixed_point(state, group)
        decay, _, _ = drift_coefficients(group["lr"], group["sigma2"], group["drift"])
        _step_mean(p, state, decay, g, inv_s, divide=True)


def _step_mean(p: Tensor, state: dict[str, Any], decay: float, a: Tensor, b: Tensor, divide: bool = False) -> None:
    """mu_post = p + a * b (or p + a / b) (Eq. 10), then p = decay * mu_post, the next prior mean (Eq. 9).

    Without decay (sigma^2 = inf) the posterior mean *is* the next prior mean, so it is not stored a second
    time (``state["mu_post"]`` only exists when they differ; ``posterior_mean()`` handles both)."""
    if decay == 1.0:
        state.pop("mu_post", None)
        if divide:
            p.addcdiv_(a, b)
        else:
            p.addcmul_(a, b)
        return
    mu = state.get("mu_post")
    if mu is None:
        mu = state["mu_post"] = torch.empty_like(p)
    if divide:
        torch.addcdiv(p, a, b, out=mu)
    else:
        torch.addcmul(p, a, b, out=mu)
    torch.mul(mu, decay, out=p)
