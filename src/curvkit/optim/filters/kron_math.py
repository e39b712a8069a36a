"""Kronecker-factored Gaussian filtering algebra (Aitchison 2018, Sec. 2.1.3, Eqs. 22-28, SI Sec. 4.3).

Convention: a layer's weight W is (M, N) = (out, in) (N includes the appended 1 of the bias); the paper's
latent z = vec(W) is **column-stacking** (the paper does not say; it is the stacking for which its
g = x (x) delta^g holds), e = x (x) delta, and the covariance is
Sigma = Sigma^x (x) Sigma^delta with Sigma^x (N, N), Sigma^delta (M, M). Then
(Sigma^x (x) Sigma^delta)(x (x) delta) = vec(Sigma^delta delta x^T Sigma^x), so the mean update is
W <- W + Sigma^delta G Sigma^x. In curvkit's row-major layout the same covariance is
Sigma^delta (x) Sigma^x (a :class:`~curvkit.linalg.kron.KroneckerBlock` with G = Sigma^delta, A = Sigma^x).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from curvkit.linalg.kron import psd_eigh as robust_eigh  # noqa: F401  (re-exported for the filters)


def kron_vec(x: Tensor, d: Tensor) -> Tensor:
    """Column-stacking vec of d x^T: x (x) delta."""
    return torch.kron(x, d)


def rank1_posterior(Sx: Tensor, Sd: Tensor, x: Tensor, d: Tensor) -> Tensor:
    """Eq. 23: the exact (dense, column-stacking) posterior after one rank-1 Fisher sample x (x) delta."""
    u, v = Sx @ x, Sd @ d
    return torch.kron(Sx, Sd) - torch.kron(torch.outer(u, u), torch.outer(v, v)) / (1.0 + (d @ v) * (x @ u))


def project_first_order(Sx: Tensor, Sd: Tensor, x: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 24, **corrected**: first-order KL projection of Eq. 23 onto Kronecker form.

        X~ = x^T Sx x / N,  D~ = d^T Sd d / M,  D = 1 + (M D~)(N X~)
        Sx' = Sx + (1/2 D~ X~ Sx - D~ (Sx x)(Sx x)^T) / D
        Sd' = Sd + (1/2 D~ X~ Sd - X~ (Sd d)(Sd d)^T) / D

    Derived from SI Eq. 32 with X1 = Sx, Y1 = Sd, X2 = Sx x x^T Sx / sqrt(1+XD), Y2 = -Sd d d^T Sd / sqrt(1+XD).
    As printed, Eq. 24 disagrees with this derivation (SI Sec. 4.3.1) in two ways: X and Delta must be the
    normalised X~ and D~ above, and the coefficient of (Sd d)(Sd d)^T in Eq. 24b must be X~, not Delta. The
    printed form is wrong at first order and diverges in a filter loop
    (:func:`project_first_order_as_printed`). SI Sec. 4.3.1 also prints a stray x in Y2.
    """
    N, M = Sx.shape[0], Sd.shape[0]
    u, v = Sx @ x, Sd @ d
    Xt, Dt = (x @ u) / N, (d @ v) / M
    D = 1.0 + (M * Dt) * (N * Xt)
    Sx_new = Sx + (0.5 * Dt * Xt * Sx - Dt * torch.outer(u, u)) / D
    Sd_new = Sd + (0.5 * Dt * Xt * Sd - Xt * torch.outer(v, v)) / D
    return Sx_new, Sd_new


def project_first_order_as_printed(Sx: Tensor, Sd: Tensor, x: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 24 exactly as printed (unnormalised X, Delta; coefficient Delta in 24b). **Wrong** (see
    :func:`project_first_order`):
    kept only for the regression test that shows it diverges in a filter loop. Do not use."""
    N, M = Sx.shape[0], Sd.shape[0]
    u, v = Sx @ x, Sd @ d
    X, Dl = x @ u, d @ v
    D = 1.0 + (M * Dl) * (N * X)
    return (Sx + (0.5 * Dl * X * Sx - Dl * torch.outer(u, u)) / D,
            Sd + (0.5 * Dl * X * Sd - Dl * torch.outer(v, v)) / D)


def project_first_order_batched(Sx: Tensor, Sd: Tensor, X: Tensor, Dm: Tensor) -> tuple[Tensor, Tensor]:
    """Sum of the corrected Eq. 24 increments of K rank-1 samples, all evaluated at the same prior
    (rows of X (K, N) and Dm (K, M)). Equal to the sequential application to first order (the order of
    Eq. 24 itself); a few matrix products instead of a Python loop."""
    N, M = Sx.shape[0], Sd.shape[0]
    U, V = X @ Sx, Dm @ Sd                      # (K, N), (K, M)
    Xt = (U * X).sum(1) / N
    Dt = (V * Dm).sum(1) / M
    Dn = 1.0 + (M * Dt) * (N * Xt)
    c = 0.5 * (Dt * Xt / Dn).sum()
    Sx_new = Sx * (1 + c) - (U * (Dt / Dn)[:, None]).T @ U
    Sd_new = Sd * (1 + c) - (V * (Xt / Dn)[:, None]).T @ V
    return Sx_new, Sd_new


def project_first_order_rows(Sx: Tensor, Sd: Tensor, L: Tensor, R: Tensor, sequential: bool = True
                             ) -> tuple[Tensor, Tensor]:
    """The corrected Eq. 24 for per-example gradients of any rank: example n's gradient matrix is
    E_n = L_n^T R_n (M, N), T rows per example (L_n (T, M) output side, R_n (T, N) input side), e_n = vec(E_n)
    (column-stacking: vec(delta x^T) = x (x) delta). ``L`` is (K, T, M), ``R`` (K, T, N).

    The rank-one Kalman step Sigma' = Sigma - Sigma e e^T Sigma / (1 + e^T Sigma e) with Sigma = Sx (x) Sd has
    Sigma e = vec(F), F = Sd E Sx. By F's SVD, vec(F) vec(F)^T is a sum of Kronecker terms, and SI Eq. 32's
    first-order projection is linear in those terms; summed over them it gives, with
    s = tr(Sx E^T Sd E) = e^T Sigma e and D = 1 + s,

        Sx' = Sx + ( s/(2NM) Sx - (1/M) Sx E^T Sd E Sx ) / D
        Sd' = Sd + ( s/(2NM) Sd - (1/N) Sd E Sx E^T Sd ) / D

    (for E = delta x^T exactly :func:`project_first_order`). With E = L^T R everything is T x T products:
    P = R Sx (T, N), Q = L Sd (T, M), Kx = L Sd L^T, Kd = R Sx R^T (T, T), s = sum(Kd * Kx),
    Sx E^T Sd E Sx = P^T Kx P, Sd E Sx E^T Sd = Q^T Kd Q: O(T (N^2 + M^2) + T^2 (N + M)) per example. When
    T > min(M, N) (a convolution's many locations) E_n itself is formed and written with min(M, N) rows
    (E = I_M^T E, or E = (E^T)^T I_N), so a step never costs more than O(min(M, N) (N^2 + M^2)) per example.

    ``sequential=True``: example after example (each step's factors are the next one's prior);
    ``sequential=False``: the sum of the K increments, all at the given factors (as
    :func:`project_first_order_batched` for rank-one samples; equal to first order). Both returned symmetric.
    """
    if L.dim() != 3 or R.dim() != 3 or L.shape[:2] != R.shape[:2]:
        raise ValueError(f"L and R must be (K, T, M) and (K, T, N) with the same K and T, got {tuple(L.shape)} "
                         f"and {tuple(R.shape)}")
    N, M = Sx.shape[0], Sd.shape[0]
    if R.shape[2] != N or L.shape[2] != M:
        raise ValueError(f"L and R must have M = {M} and N = {N} columns, got {L.shape[2]} and {R.shape[2]}")
    K, T = L.shape[:2]
    if T > min(M, N):
        E = L.transpose(1, 2) @ R                       # (K, M, N)
        if M <= N:
            L, R = torch.eye(M, dtype=E.dtype, device=E.device).expand(K, M, M), E
        else:
            L, R = E.transpose(1, 2), torch.eye(N, dtype=E.dtype, device=E.device).expand(K, N, N)
        T = min(M, N)
    if sequential:
        for Ln, Rn in zip(L, R):
            P, Q = Rn @ Sx, Ln @ Sd
            Kx, Kd = Q @ Ln.T, P @ Rn.T
            Kx, Kd = 0.5 * (Kx + Kx.T), 0.5 * (Kd + Kd.T)
            s = float((Kd * Kx).sum())
            D = 1.0 + s
            a = 1.0 + 0.5 * s / (N * M * D)
            Sx = symmetrise(torch.addmm(Sx, P.T, Kx @ P, beta=a, alpha=-1.0 / (M * D)))
            Sd = symmetrise(torch.addmm(Sd, Q.T, Kd @ Q, beta=a, alpha=-1.0 / (N * D)))
        return Sx, Sd
    P, Q = R @ Sx, L @ Sd                               # (K, T, N), (K, T, M)
    Kx, Kd = Q @ L.transpose(1, 2), P @ R.transpose(1, 2)
    Kx, Kd = 0.5 * (Kx + Kx.transpose(1, 2)), 0.5 * (Kd + Kd.transpose(1, 2))
    sk = (Kd * Kx).sum((1, 2))                          # (K,)
    Dn = 1.0 + sk
    a = 1.0 + 0.5 * float((sk / Dn).sum()) / (N * M)
    wx, wd = (Kx / Dn[:, None, None]) @ P, (Kd / Dn[:, None, None]) @ Q
    Sx_new = torch.addmm(Sx, P.reshape(K * T, N).T, wx.reshape(K * T, N), beta=a, alpha=-1.0 / M)
    Sd_new = torch.addmm(Sd, Q.reshape(K * T, M).T, wd.reshape(K * T, M), beta=a, alpha=-1.0 / N)
    return symmetrise(Sx_new), symmetrise(Sd_new)


def rows_kron_vec(L: Tensor, R: Tensor) -> Tensor:
    """e_n = vec(L_n^T R_n) (column-stacking), (K, N M), for L (K, T, M), R (K, T, N): the per-example Fisher
    samples of :func:`project_first_order_rows` as vectors (for the dense, exact route)."""
    return (R.transpose(1, 2) @ L).reshape(L.shape[0], -1)


class SampleUpdate(NamedTuple):
    """K first-order data updates in the span of the samples (:func:`first_order_coefficients`):

        Sx' = alpha Sx - U0^T Rx^T diag(sx) Rx U0,   Sd' = alpha Sd - V0^T Rd^T diag(sd) Rd V0,

    Rx, Rd (K, K) (batched from Gram diagonals: their diagonals (K,), see :func:`apply_root`), signs sx, sd
    (K,) (all +1 unless rounding made a factor indefinite)."""

    alpha: float
    Rx: Tensor
    Rd: Tensor
    sx: Tensor
    sd: Tensor


def first_order_coefficients(Gx: Tensor, Gd: Tensor, N: int, M: int, sequential: bool = True) -> SampleUpdate:
    """The corrected Eq. 24 applied to K rank-1 samples, in the K-dimensional span of the samples.

    With the prior factors Sx (N, N), Sd (M, M), the samples X (K, N), Dm (K, M), U0 = X Sx, V0 = Dm Sd and
    the Gram matrices ``Gx`` = X Sx X^T, ``Gd`` = Dm Sd Dm^T (K, K), the K updates give
    Sx' = alpha Sx - U0^T Px U0, Sd' = alpha Sd - V0^T Pd V0 with Px = Rx^T diag(sx) Rx (see
    :class:`SampleUpdate`; the square-root form keeps Sx' symmetric without a transpose pass).

    ``sequential=True``: Eq. 24 sample after sample (the paper's rank-1 updates, Sec. 2.1.3). Each update
    maps Sx to a Sx - p u u^T with u = Sx x, a = 1 + Dt Xt / (2 D) (the same a for both factors),
    p = Dt / D (x side) or Xt / D (delta side), so by induction every u_j lies in the row span of U0:
    u_j = U0^T c_j with c_j = alpha_j e_j - P_j Gx e_j, x_j^T u_j = c_j^T Gx e_j, and
    alpha_{j+1} = a_j alpha_j, P_{j+1} = a_j P_j + p_j c_j c_j^T (rows of R: sqrt(|p_j| prod_{l>j} a_l) c_j).
    Exact (nothing beyond Eq. 24 itself), O(K^3) work instead of K passes over the N x N and M x M factors.

    ``sequential=False``: the summed increments of :func:`project_first_order_batched` (all samples at the
    prior): alpha = 1 + sum_j Dt_j Xt_j / (2 D_j), Px = diag(Dt / D), Pd = diag(Xt / D).

    The small recursion runs in float64; the result is in the dtype and on the device of ``Gx``.
    """
    K = Gx.shape[0]
    square = Gx.shape == (K, K) and Gd.shape == (K, K)
    if not (square or (not sequential and Gx.shape == (K,) and Gd.shape == (K,))):
        raise ValueError(f"Gx and Gd must both be (K, K) (or, batched, their diagonals (K,)), got {tuple(Gx.shape)} "
                         f"and {tuple(Gd.shape)}")
    if not square:   # batched with the diagonals only: R is diagonal, returned as its diagonal (K,)
        Xt, Dt = Gx.double() / N, Gd.double() / M
        den_t = 1.0 + (M * Dt) * (N * Xt)
        wxt, wdt = Dt / den_t, Xt / den_t
        one = torch.ones_like(wxt)
        return SampleUpdate(1.0 + 0.5 * float((Dt * Xt / den_t).sum()), wxt.abs().sqrt().to(Gx.dtype),
                            wdt.abs().sqrt().to(Gx.dtype), torch.where(wxt < 0, -one, one).to(Gx.dtype),
                            torch.where(wdt < 0, -one, one).to(Gx.dtype))
    gx = Gx.detach().to("cpu", torch.float64).numpy()
    gd = Gd.detach().to("cpu", torch.float64).numpy()
    if sequential:
        Px, Pd = np.zeros((K, K)), np.zeros((K, K))
        Cx, Cd = np.zeros((K, K)), np.zeros((K, K))
        px, pd, acum = np.zeros(K), np.zeros(K), np.ones(K)
        alpha = 1.0
        for j in range(K):
            cx = -(Px @ gx[:, j])
            cd = -(Pd @ gd[:, j])
            cx[j] += alpha
            cd[j] += alpha
            xt = float(cx @ gx[:, j]) / N
            dt = float(cd @ gd[:, j]) / M
            den = 1.0 + (M * dt) * (N * xt)
            a = 1.0 + 0.5 * dt * xt / den
            Px *= a
            Px += (dt / den) * np.outer(cx, cx)
            Pd *= a
            Pd += (xt / den) * np.outer(cd, cd)
            Cx[j], Cd[j], px[j], pd[j] = cx, cd, dt / den, xt / den
            acum[:j] *= a
            alpha *= a
        wx, wd = px * acum, pd * acum
        Rx, Rd = Cx * np.sqrt(np.abs(wx))[:, None], Cd * np.sqrt(np.abs(wd))[:, None]
    else:
        xv, dv = np.diagonal(gx) / N, np.diagonal(gd) / M
        den_v = 1.0 + (M * dv) * (N * xv)
        alpha = 1.0 + 0.5 * float((dv * xv / den_v).sum())
        wx, wd = dv / den_v, xv / den_v
        Rx, Rd = np.diag(np.sqrt(np.abs(wx))), np.diag(np.sqrt(np.abs(wd)))

    def out(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype=Gx.dtype, device=Gx.device)

    return SampleUpdate(alpha, out(Rx), out(Rd), out(np.where(wx < 0, -1.0, 1.0)), out(np.where(wd < 0, -1.0, 1.0)))


def apply_root(R: Tensor, U0: Tensor) -> Tensor:
    """W = R U0 for R (K, K), or diag(R) U0 for R (K,) (the batched update)."""
    return R[:, None] * U0 if R.dim() == 1 else R @ U0


def low_rank_update(S0: Tensor, W: Tensor, alpha: float, sign: Tensor) -> Tensor:
    """alpha S0 - W^T diag(sign) W (S0 (n, n), W = R U0 (K, n)): a factor after :func:`first_order_coefficients`.
    With all signs +1 (the normal case) the product is a Gram matrix, so a symmetric S0 stays symmetric."""
    if bool((sign > 0).all()):
        return torch.addmm(S0, W.T, W, beta=alpha, alpha=-1.0)
    S = torch.addmm(S0, (W * sign[:, None]).T, W, beta=alpha, alpha=-1.0)
    return S.add(S.T).mul_(0.5)


def rows_after_update(Y: Tensor, Xg: Tensor, W: Tensor, alpha: float, sign: Tensor) -> Tensor:
    """Xg S' for S' = alpha S0 - W^T diag(sign) W, given Y = Xg S0 (B, n): alpha Y - (Xg W^T) diag(sign) W,
    O(B K n), written into Y (returned)."""
    return Y.addmm_((Xg @ W.T) * sign, W, beta=alpha, alpha=-1.0)


def symmetrise(S: Tensor) -> Tensor:
    """(S + S^T)/2."""
    return S.add(S.T).mul_(0.5)


def mean_inverse_diagonal(S: Tensor) -> Tensor:
    """tr(S^{-1})/n for a symmetric positive definite S (n, n) (Lambda of Eq. 28): ||L^{-1}||_F^2 / n with the
    Cholesky factor S = L L^T, about a third of the work of an explicit inverse; falls back to
    ``torch.linalg.inv`` when S is not numerically positive definite."""
    L, info = torch.linalg.cholesky_ex(S)
    if int(info) == 0:
        eye = torch.eye(S.shape[0], dtype=S.dtype, device=S.device)
        return torch.linalg.solve_triangular(L, eye, upper=False).square().sum() / S.shape[0]
    return torch.diagonal(torch.linalg.inv(S)).mean()


def sandwich_costs(B: int, K: int, M: int, N: int, shared_rows: bool) -> tuple[int, int]:
    """Flops (low-rank route, dense route) of one first-order KFBayes step for a layer with B gradient rows,
    K Fisher samples, M outputs, N inputs, beyond what both routes share (the factor updates, 2K(M^2 + N^2)).

    Low-rank: Y = Xg S0x, Z = Dg S0d (2B(N^2 + M^2); U0, V0 are K of their rows when ``shared_rows``),
    the corrections of :func:`rows_after_update` (4BK(N + M)) and Z'^T Y' (2BMN). Dense: U0, V0
    (2K(N^2 + M^2)) and Sd' G Sx' (2MN(M + N))."""
    low = 2 * B * (N * N + M * M) + 4 * B * K * (N + M) + 2 * B * M * N
    dense = 2 * M * N * (M + N)
    if not shared_rows:
        low += 2 * K * (N * N + M * M)
    dense += 2 * K * (N * N + M * M)
    return low, dense


def kl_project(Sigma: Tensor, N: int, M: int, init: tuple[Tensor, Tensor] | None = None,
               iters: int = 500, tol: float = 1e-13) -> tuple[Tensor, Tensor]:
    """Exact KL(P || Q) projection of a dense column-stacking covariance (NM, NM) onto A (x) B
    (A (N, N), B (M, M)) by the flip-flop fixed point of SI 4.3:
    A = (1/M) tr_delta[(I (x) B^{-1}) Sigma],  B = (1/N) tr_x[(A^{-1} (x) I) Sigma].
    Scale is split so that tr(A)/N = tr(B)/M."""
    if Sigma.shape != (N * M, N * M):
        raise ValueError(f"Sigma must be ({N * M}, {N * M}) for N={N}, M={M}, got {tuple(Sigma.shape)}")
    S4 = Sigma.reshape(N, M, N, M)
    A, B = init if init is not None else (torch.eye(N, dtype=Sigma.dtype), torch.eye(M, dtype=Sigma.dtype))
    for _ in range(iters):
        A_new = torch.einsum("iajb,ba->ij", S4, torch.linalg.inv(B)) / M
        B_new = torch.einsum("iajb,ji->ab", S4, torch.linalg.inv(A_new)) / N
        done = torch.linalg.norm(torch.kron(A_new, B_new) - torch.kron(A, B)) <= tol * torch.linalg.norm(Sigma)
        A, B = 0.5 * (A_new + A_new.T), 0.5 * (B_new + B_new.T)
        if bool(done):
            break
    return rebalance(A, B)


def rebalance(Sx: Tensor, Sd: Tensor) -> tuple[Tensor, Tensor]:
    """Move the (arbitrary) common scale so that tr(Sx)/N = tr(Sd)/M; Sx (x) Sd is unchanged.

    SI Sec. 4.3 notes the scale invariance and fixes only the product of the two scales; this split is the
    choice made here."""
    ax = torch.diagonal(Sx).mean()
    ad = torch.diagonal(Sd).mean()
    r = torch.sqrt(ad / ax)
    return Sx * r, Sd / r


def drift_project(Sx: Tensor, Sd: Tensor, eta: float, decay: float,
                  lam_x: Tensor | float | None = None, lam_d: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 28: first-order projection of decay^2 Sx (x) Sd + eta^2 I (x) I onto Kronecker form,

        Sx' = (decay - 1/2 eta^2 Lx Ld) Sx + eta^2 Ld I,   Sd' = (decay - 1/2 eta^2 Lx Ld) Sd + eta^2 Lx I,
        Lx = tr(Sx^{-1})/N,  Ld = tr(Sd^{-1})/M  (passed in when cached: the paper finds inverting the
        factors "not desirable" and leaves the approximation open).

    ``decay`` = 1 - eta^2/(2 sigma^2) is the paper's per-factor decay (its square is the covariance decay).
    """
    if lam_x is None:
        lam_x = torch.diagonal(torch.linalg.inv(Sx)).mean()
    if lam_d is None:
        lam_d = torch.diagonal(torch.linalg.inv(Sd)).mean()
    e2 = eta * eta
    c = decay - 0.5 * e2 * lam_x * lam_d
    Sx_new, Sd_new = Sx * c, Sd * c
    Sx_new.diagonal().add_(e2 * lam_d)
    Sd_new.diagonal().add_(e2 * lam_x)
    return Sx_new, Sd_new


# ------------------------------------------------------------------------------- products with Sigma
def low_rank_is_cheaper(K: int, M: int, N: int) -> bool:
    """Whether L G R (L (M, M), R (N, N), G = D^T X with K rows) is cheaper through the factors:
    about 2K(M^2 + N^2 + MN) (plus the rotations of :func:`whitened_gradient`) against 2MN(M + N)."""
    return K * (2 * M * M + 2 * N * N + 2 * M * N) < 2 * M * N * (M + N)


def whitening_low_rank_is_cheaper(K: int, M: int, N: int, rotated: bool) -> bool:
    """Whether :func:`whitened_gradient` is cheaper through the gradient's K per-example rows: the rotations
    D V_d, X V_x (2K(M^2 + N^2), free when ``rotated``: KFWhiten computes them for its second moments anyway),
    the back-rotations (2K(M^2 + N^2)) and the product (2KMN), against the four dense products of the direct
    route, 4MN(M + N)."""
    low = 2 * K * (M * M + N * N) * (1 if rotated else 2) + 2 * K * M * N
    return low < 4 * M * N * (M + N)


def gradient_residual(G: Tensor | tuple[Tensor, Tensor | None], D: Tensor, X: Tensor) -> Tensor | None:
    """None when G (M, N) = D^T X (D (K, M), X (K, N)) up to rounding, else the residual G - D^T X.
    G may be given in two parts (Gw (M, N-1), gb (M,)) for G = [Gw | gb] (not concatenated unless a residual
    is found).

    Checked with one deterministic random probe r in O(MN + K(M + N)) flops: ||(G - D^T X) r|| against
    100 sqrt(K) eps ||G r||. A residual (an L2 penalty on the weights, a layer called twice per forward pass,
    a hook-free gradient edit) is orthogonal to a fixed random r with probability 0."""
    Gw, gb = G if isinstance(G, tuple) else (G, None)
    r = torch.randn(X.shape[1], 1, generator=torch.Generator().manual_seed(20180719), dtype=X.dtype).to(X.device)
    Gr = Gw @ r[:Gw.shape[1]]
    if gb is not None:
        Gr.add_(gb[:, None] * r[-1])
    tol = 100.0 * math.sqrt(X.shape[0]) * torch.finfo(X.dtype).eps
    if float(torch.linalg.norm(Gr - D.T @ (X @ r))) <= tol * float(torch.linalg.norm(Gr)):
        return None
    full = Gw if gb is None else torch.cat([Gw, gb[:, None]], dim=1)
    return full - D.T @ X


def kron_sandwich(L: Tensor, G: Tensor, R: Tensor, factors: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """L G R for symmetric L (M, M), R (N, N): the Kronecker mean update Sigma^delta G Sigma^x (Eq. 6).

    With the gradient's per-example factors ``(D (K, M), X (K, N))`` (G = D^T X for a Linear layer) and
    small K it is computed as (D L)^T (X R); any part of G the factors do not explain is added by the
    direct route (:func:`gradient_residual`), so the result does not depend on the route."""
    if factors is None or not low_rank_is_cheaper(factors[0].shape[0], L.shape[0], R.shape[0]):
        return L @ G @ R
    D, X = factors
    out = (D @ L).T @ (X @ R)
    res = gradient_residual(G, D, X)
    return out if res is None else out + L @ res @ R


def whitened_gradient(G: Tensor, Vd: Tensor, sd: Tensor, Vx: Tensor, sx: Tensor,
                      factors: tuple[Tensor, Tensor] | None = None,
                      rotated: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """U = P_d G P_x with P_d = V_d diag(s_d) V_d^T (M, M), P_x = V_x diag(s_x) V_x^T (N, N), G (M, N):
    the whitening step C_delta^{-1/2} G C_x^{-1/2} (end of Sec. 2.1.3) from the factors' eigenbases without
    forming P_d, P_x.

    Without ``factors``: four products, 4MN(M+N) flops. With the gradient's per-example factors
    ``(D (K, M), X (K, N))``: (V_d diag(s_d) (D V_d)^T)(X V_x diag(s_x) V_x^T), about 2K(2M^2 + 2N^2 + MN) flops
    (less when ``rotated`` = (D V_d, X V_x) is already known); a residual G - D^T X is whitened by the direct
    route (:func:`gradient_residual`), so the result does not depend on the route. The caller picks the route
    (:func:`low_rank_is_cheaper`)."""
    def full(R: Tensor) -> Tensor:
        return Vd @ ((Vd.T @ R @ Vx) * torch.outer(sd, sx)) @ Vx.T

    if factors is None:
        return full(G)
    D, X = factors
    DV, XV = rotated if rotated is not None else (D @ Vd, X @ Vx)
    U = (Vd @ (DV * sd).T) @ ((XV * sx) @ Vx.T)
    res = gradient_residual(G, D, X)
    return U if res is None else U + full(res)

