"""The quadratic model of thesis Sec. 4.4 and the two damping rules, as plain functions of scalars.

Notation (thesis Eqs. 4.12-4.22): E is the objective on the minibatch, g = grad E, C = G + (lambda + tau) I
the exact minibatch GGN plus weight decay and Levenberg-Marquardt damping, and for a direction d

    q(alpha d) - q(0) = alpha d^T g + (alpha^2 / 2) d^T C d                        (4.17)

which is minimised by

    alpha* = -(d^T g) / (d^T C d),   q(alpha* d) - q(0) = -(d^T g)^2 / (2 d^T C d)      (4.18)

The reduction ratio of a step is rho = (E(theta + step) - E(theta)) / (q(step) - q(0)) (Eq. 4.21, the
same minibatch on both sides). Over two directions (the optional update momentum, KFAC-style) the model
is q(a d_1 + b d_2) - q(0) = [a b] v + (1/2) [a b] M [a b]^T with M_ij = d_i^T C d_j, v_i = d_i^T g, and
its minimiser [a b] = -M^{-1} v reduces q by -(1/2) v^T M^{-1} v = (1/2) [a b] v.

Every function returns plain Python floats; the optimiser checks them for finiteness before it writes.
"""

from __future__ import annotations

import math
from typing import Literal

LMRule = Literal["band", "threshold"]

__all__ = ["LMRule", "levenberg_marquardt", "line_minimum", "reduction_ratio", "two_direction_minimum"]


def line_minimum(dg: float, dCd: float) -> tuple[float, float]:
    """(alpha*, q(alpha* d) - q(0)) of Eq. 4.18 for ``dg = d^T g`` and ``dCd = d^T C d > 0``.

    A flat model (``dg = 0`` and ``dCd = 0``: a zero direction, e.g. from a zero gradient) is minimised by
    alpha = 0 (no step) and gives (0, 0). Raises ``FloatingPointError`` when ``dCd`` is not a positive finite
    number otherwise (the model has no minimum along d: zero curvature with zero damping).
    """
    if dg == 0 and dCd == 0:
        return 0.0, 0.0
    if not (math.isfinite(dCd) and dCd > 0 and math.isfinite(dg)):
        raise FloatingPointError(f"the quadratic model along the direction has d^T C d = {dCd:.3g} and d^T g = "
                                 f"{dg:.3g}; it needs d^T C d > 0 (zero damping with zero curvature along d): "
                                 "increase tau or weight_decay")
    alpha = -dg / dCd
    return alpha, 0.5 * alpha * dg


def two_direction_minimum(M: list[list[float]], v: list[float]) -> tuple[float, float, float] | None:
    """(a, b, q(a d_1 + b d_2) - q(0)) minimising the model over span{d_1, d_2} (module docstring), or None
    when the 2 x 2 matrix M is not (numerically) positive definite, e.g. collinear directions; the caller
    then falls back to :func:`line_minimum` along d_1."""
    m11, m12, m22 = M[0][0], 0.5 * (M[0][1] + M[1][0]), M[1][1]
    det = m11 * m22 - m12 * m12
    if not (math.isfinite(det) and m11 > 0 and m22 > 0 and det > 1e-10 * m11 * m22):
        return None
    a = -(m22 * v[0] - m12 * v[1]) / det
    b = -(-m12 * v[0] + m11 * v[1]) / det
    return a, b, 0.5 * (a * v[0] + b * v[1])


def reduction_ratio(actual_change: float, predicted_change: float) -> float:
    """rho = (E(theta + step) - E(theta)) / (q(step) - q(0)) (Eq. 4.21).

    A non-finite new objective (overflow) counts as ``-inf`` (the worst possible step); NaN is returned
    when the model predicts no change, in which case the damping is left alone.
    """
    if not (predicted_change < 0):
        return math.nan
    if not math.isfinite(actual_change):
        return -math.inf
    return actual_change / predicted_change


def levenberg_marquardt(tau: float, rho: float, omega: float, rule: LMRule = "band",
                        low: float = 0.25, high: float = 0.75) -> float:
    """The Levenberg-Marquardt update of tau (thesis Sec. 4.4.1) with decay constant ``omega`` < 1.

    * ``rule='band'`` (default, the classical rule of Martens 2010): rho > ``high`` (3/4) -> omega tau (the
      model is trustworthy, damp less); rho < ``low`` (1/4) -> tau / omega; otherwise unchanged.
    * ``rule='threshold'`` (the thesis as printed, with its "rho" for "tau" typo fixed): rho > 3/4 ->
      omega tau, otherwise tau / omega.

    A NaN rho (no predicted change) leaves tau unchanged.
    """
    if math.isnan(rho):
        return tau
    if rule == "band":
        if rho > high:
            return tau * omega
        if rho < low:
            return tau / omega
        return tau
    if rule == "threshold":
        return tau * omega if rho > high else tau / omega
    raise ValueError(f"unknown Levenberg-Marquardt rule {rule!r}; use 'band' or 'threshold'")
