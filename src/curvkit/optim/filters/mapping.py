"""Hyperparameter maps between the Bayesian filters and the usual optimisers, steady-state formulas,
and the SGD-like / Adam-like regime indicator (Aitchison 2018, Secs. 2.1.1-2.1.2 and 2.2.1, SI Sec. 4.2).

The regime indicator is not in this version of the paper (its later version makes the SGD-like and
Adam-like regimes its central point); here it is read off the finite-sigma^2 fixed point of the scalar
filter, :func:`rmsprop_fixed_point`.

All quantities are per step and use the summed log-likelihood (see :mod:`._base`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import solve_discrete_are, solve_discrete_lyapunov

from curvkit.optim.filters._base import check_positive


# ----------------------------------------------------------------------------- hyperparameter maps
def eta_from_adam_lr(lr: float) -> float:
    """eta (diffusion sd of the optimum) = Adam/RMSProp learning rate in the steady state (Sec. 2.1.2)."""
    return check_positive("lr", lr)


def adam_lr_from_eta(eta: float) -> float:
    return check_positive("eta", eta)


def eta_p_from_beta1(beta1: float) -> float:
    """Momentum decay eta_p = 1 - beta1 (Eq. 15 vs Adam)."""
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"beta1 must lie in [0, 1), got {beta1!r}")
    return 1.0 - beta1


def beta1_from_eta_p(eta_p: float) -> float:
    if not 0.0 < eta_p <= 1.0:
        raise ValueError(f"eta_p must lie in (0, 1], got {eta_p!r}")
    return 1.0 - eta_p


def sigma2_from_weight_decay(lr: float, weight_decay: float, eta_w: float = 0.0) -> float:
    """Stationary prior variance matching AdamW(lr, weight_decay): per-step decay lr*wd = (eta^2+eta_w^2)/(2 sigma^2).

    ``weight_decay = 0`` gives ``inf`` (no decay). Note the decay then scales as eta^2 at fixed sigma^2.
    """
    lr = check_positive("lr", lr)
    wd = check_positive("weight_decay", weight_decay, allow_zero=True)
    if wd == 0:
        return math.inf
    return (lr**2 + eta_w**2) / (2.0 * lr * wd)


def weight_decay_from_sigma2(lr: float, sigma2: float, eta_w: float = 0.0) -> float:
    """Inverse of :func:`sigma2_from_weight_decay` (AdamW-style decoupled decay per unit lr)."""
    lr = check_positive("lr", lr)
    s2 = check_positive("sigma2", sigma2, allow_inf=True)
    return 0.0 if math.isinf(s2) else (lr**2 + eta_w**2) / (2.0 * lr * s2)


def sigma2_from_sgd_lr(lr_sgd: float, batch_size: int) -> float:
    """Prior variance (SGD cap) equal to an SGD learning rate on the *mean* loss: sigma^2 = lr_sgd / B."""
    lr_sgd = check_positive("lr_sgd", lr_sgd)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return lr_sgd / batch_size


def sgd_lr_from_sigma2(sigma2: float, batch_size: int) -> float:
    return check_positive("sigma2", sigma2) * batch_size


# ----------------------------------------------------------------------------- steady states
def rmsprop_fixed_point(eta: float, fisher: float, sigma2: float = math.inf) -> float:
    """Continuous-time fixed point of the scalar filter (Sec. 2.1.1, Eqs. 8-12):
    ``1/s = 1/(2 sigma^2) + sqrt(1/(4 sigma^4) + <e^2>/eta^2)``; ``s = eta/sqrt(<e^2>)`` when sigma^2 = inf.

    The paper gives only the sigma^2 = inf form (the steady state after Eq. 14, from the SI Sec. 4.1
    recursion); the finite-sigma^2 form keeps that recursion's decay term -(eta^2/sigma^2) s (derived)."""
    if math.isinf(sigma2):
        return eta / math.sqrt(fisher)
    c = 1.0 / (2.0 * sigma2)
    return 1.0 / (c + math.sqrt(c * c + fisher / eta**2))


def rmsprop_discrete_fixed_point(eta: float, fisher: float) -> float:
    """Exact fixed point of Eqs. 11-12 with sigma^2 = inf: ``s* = -eta^2/2 + sqrt(eta^4/4 + eta^2/E)``.

    Derived; the paper's continuous-time eta/sqrt(E) differs from it by about -eta sqrt(E)/2 relative."""
    return -(eta**2) / 2 + math.sqrt(eta**4 / 4 + eta**2 / fisher)


def regime(s: float, eta: float, sigma2: float, fisher: float) -> dict[str, float | str]:
    """SGD-likeness ``s/sigma^2`` (-> 1 in the SGD limit) and Adam-likeness ``s sqrt(v)/eta`` (-> 1 in the
    Adam limit) of a posterior variance ``s`` (not in this version of the paper; see the module docstring).
    ``regime`` is the larger of the two."""
    sgd = s / sigma2 if math.isfinite(sigma2) else 0.0
    adam = s * math.sqrt(fisher) / eta if eta > 0 else 0.0
    return {"sgd_like": sgd, "adam_like": adam, "regime": "sgd" if sgd > adam else "adam"}


def momentum_transition(eta: float, eta_p: float, eta_w: float = 0.0, sigma2: float = math.inf
                        ) -> tuple[np.ndarray, np.ndarray]:
    """F = I - A and Q of the weight+momentum model (Eq. 16), paper (first-order) discretisation."""
    a = 0.0 if math.isinf(sigma2) else (eta**2 + eta_w**2) / (2 * sigma2)
    F = np.array([[1 - a, eta], [0.0, 1 - eta_p]])
    Q = np.diag([eta_w**2, eta_p**2])
    return F, Q


def momentum_stationary_prior(eta: float, eta_p: float, eta_w: float = 0.0, sigma2: float = 1.0) -> np.ndarray:
    """Stationary covariance Psi = F Psi F^T + Q of (w, p). Needs a finite sigma^2.

    Solved exactly; SI Sec. 4.2 gives the first-order solution Psi_ww ~ sigma^2, Psi_wp ~ eta/2,
    Psi_pp ~ eta_p/2 (the exact Psi_pp is eta_p/(2 - eta_p))."""
    if math.isinf(sigma2):
        raise ValueError("the momentum model has no stationary prior when sigma2 = inf")
    F, Q = momentum_transition(eta, eta_p, eta_w, sigma2)
    return np.asarray(solve_discrete_lyapunov(F, Q))


def momentum_filter_fixed_point(eta: float, eta_p: float, fisher: float, eta_w: float = 0.0,
                                sigma2: float = math.inf) -> np.ndarray:
    """Steady posterior covariance [[S_ww, S_wp], [S_wp, S_pp]] of the exact 2x2 filter (Sec. 2.1.2,
    Eqs. 15-17) with a deterministic Fisher ``fisher`` = e^2, from the discrete algebraic Riccati equation
    (exact; the paper's Eqs. 19-21 are a continuous-time, first-order approximation of it)."""
    F, Q = momentum_transition(eta, eta_p, eta_w, sigma2)
    c = np.array([[math.sqrt(fisher)], [0.0]])
    Qr = Q + 1e-300 * np.eye(2)  # DARE solver wants Q symmetric PSD; keep exactly singular Q usable
    P = solve_discrete_are(F.T, c, Qr, np.array([[1.0]]))
    Pc = P @ c
    return P - Pc @ Pc.T / (1.0 + float((c.T @ Pc)[0, 0]))


def adam_closed_forms(eta: float, eta_p: float, fisher: float) -> tuple[float, float]:
    """The paper's approximate steady state: S_wp = eta_p/sqrt(E) (Eq. 21), S_ww = sqrt(2 eta eta_p)/E^{3/4}
    (the unnumbered equation after Eq. 21, from the ww entry of Eq. 20).

    Only rough: the exact filter's S_wp (:func:`momentum_filter_fixed_point`) is 0.52-0.94 of this (measured
    for eta_p from 0.1 down to 0.001)."""
    return math.sqrt(2 * eta * eta_p) / fisher**0.75, eta_p / math.sqrt(fisher)
