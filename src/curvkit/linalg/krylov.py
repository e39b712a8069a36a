"""Krylov methods on a symmetric operator given by matrix-matrix products ``matmat: (d, k) -> (d, k)``.

* :func:`lanczos` / :func:`lanczos_eigenvalues` - extreme eigenpairs by the Lanczos iteration with full
  reorthogonalisation (every new basis vector is orthogonalised twice against all previous ones, so the
  Ritz values do not develop spurious copies). On an invariant-subspace breakdown the iteration restarts
  from a fresh random vector orthogonal to the basis, so repeated eigenvalues are found with their
  multiplicity and ``num_iter = d`` gives every eigenvalue.
* :func:`conjugate_gradient` - solves A x = b for symmetric positive definite A, one or several
  right-hand sides at once (each column runs its own CG, vectorised; one product per iteration).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

MatMat = Callable[[Tensor], Tensor]


def _default_tol(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-5


def lanczos(
    matmat: MatMat,
    d: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device | str,
    which: Literal["largest", "smallest"] = "largest",
    num_iter: int | None = None,
    generator: torch.Generator | None = None,
    tol: float | None = None,
) -> tuple[Tensor, Tensor]:
    """k extreme eigenpairs of the symmetric (d, d) operator: (eigenvalues (k,), eigenvectors (d, k)).

    Eigenvalues are returned in DESCENDING order (for ``which='smallest'`` too: the k smallest,
    largest first); eigenvector columns match. ``num_iter`` (default ``min(d, max(2k + 40, 60))``) bounds
    the number of products; the iteration stops earlier once every wanted Ritz pair has residual
    |beta_j s_j| <= tol * max|theta| (default tol 1e-10 in float64, 1e-5 otherwise). Memory
    O(d * num_iter) for the basis. The start vector is Gaussian from ``generator`` (CPU by default).
    """
    if which not in ("largest", "smallest"):
        raise ValueError(f"which must be 'largest' or 'smallest', got {which!r}")
    if not 1 <= int(k) <= d:
        raise ValueError(f"k must lie in [1, d={d}], got {k}")
    m = min(d, max(2 * k + 40, 60)) if num_iter is None else int(num_iter)
    if not k <= m <= d:
        raise ValueError(f"num_iter must lie in [k={k}, d={d}], got {num_iter}")
    tol = _default_tol(dtype) if tol is None else float(tol)
    gen_device = generator.device if generator is not None else torch.device("cpu")

    def random_unit(V: Tensor | None) -> Tensor | None:
        for _ in range(5):
            q = torch.randn(d, generator=generator, device=gen_device, dtype=dtype).to(device)
            if V is not None and V.shape[1]:
                q = q - V @ (V.T @ q)
                q = q - V @ (V.T @ q)
            nrm = q.norm()
            if nrm > 1e-8:
                return q / nrm
        return None

    V = torch.zeros(d, m, dtype=dtype, device=device)
    alpha = torch.zeros(m, dtype=dtype, device=device)
    beta = torch.zeros(m, dtype=dtype, device=device)  # beta[j] couples q_j and q_{j+1}
    q = random_unit(None)
    assert q is not None
    j = 0
    while True:
        V[:, j] = q
        w = matmat(q[:, None])[:, 0]
        alpha[j] = q @ w
        Vj = V[:, :j + 1]
        w = w - Vj @ (Vj.T @ w)  # full reorthogonalisation, twice ("twice is enough")
        w = w - Vj @ (Vj.T @ w)
        b = w.norm()
        j += 1
        if j == m:
            beta[j - 1] = b
            break
        scale = alpha[:j].abs().max().clamp_min(torch.finfo(dtype).tiny)
        if b <= 1e3 * torch.finfo(dtype).eps * scale:  # invariant subspace: restart orthogonally
            beta[j - 1] = 0.0
            q_new = random_unit(Vj)
            if q_new is None:
                break
            q = q_new
        else:
            beta[j - 1] = b
            q = w / b
        if j >= k and j % 5 == 0 and _converged(alpha[:j], beta[:j], k, which, tol):
            break
    T = torch.diag(alpha[:j]) + torch.diag(beta[:j - 1], 1) + torch.diag(beta[:j - 1], -1)
    theta, S = torch.linalg.eigh(T)  # ascending
    idx = torch.arange(j - 1, j - 1 - k, -1) if which == "largest" else torch.arange(k - 1, -1, -1)
    idx = idx.to(theta.device)
    return theta[idx], V[:, :j] @ S[:, idx]


def _converged(alpha: Tensor, beta: Tensor, k: int, which: str, tol: float) -> bool:
    j = alpha.numel()
    T = torch.diag(alpha) + torch.diag(beta[:j - 1], 1) + torch.diag(beta[:j - 1], -1)
    theta, S = torch.linalg.eigh(T)
    res = (beta[j - 1] * S[-1, :]).abs()
    wanted = res[-k:] if which == "largest" else res[:k]
    return bool((wanted <= tol * theta.abs().max().clamp_min(torch.finfo(theta.dtype).tiny)).all())


def lanczos_eigenvalues(
    matmat: MatMat,
    d: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device | str,
    which: Literal["largest", "smallest"] = "largest",
    num_iter: int | None = None,
    generator: torch.Generator | None = None,
    tol: float | None = None,
) -> Tensor:
    """The k largest (or smallest) eigenvalues, descending; see :func:`lanczos`.

    >>> A = torch.diag(torch.arange(1.0, 11.0, dtype=torch.float64))
    >>> [round(v, 10) for v in lanczos_eigenvalues(lambda M: A @ M, 10, 3, torch.float64, "cpu").tolist()]
    [10.0, 9.0, 8.0]
    """
    return lanczos(matmat, d, k, dtype, device, which=which, num_iter=num_iter, generator=generator,
                   tol=tol)[0]


class NotPositiveDefiniteError(ValueError):
    """Raised by :func:`conjugate_gradient` when it meets a direction p with p^T A p <= 0."""


def conjugate_gradient(
    matmat: MatMat,
    b: Tensor,
    tol: float = 1e-10,
    max_iter: int | None = None,
    x0: Tensor | None = None,
) -> Tensor:
    """Solve A x = b by conjugate gradients for symmetric positive definite A.

    ``b`` is a (d,) vector or a (d, k) matrix of k right-hand sides (solved together, one product
    with k columns per iteration; converged columns are frozen). Stops when every column satisfies
    ||b - A x|| <= tol' * ||b||, with tol' = max(tol, 10 * eps(dtype)) (so the float64 default 1e-10
    becomes ~1.2e-6 in float32). ``max_iter`` defaults to 2 d; a warning is issued if some column has
    not converged by then. Raises :class:`NotPositiveDefiniteError` (a ValueError) if a search direction
    p with p^T A p <= 0 is met: the operator is not positive definite (add damping, e.g.
    ``op.solve(b, damping=1e-3)``).
    """
    if b.dim() not in (1, 2):
        raise ValueError(f"right-hand side must be a (d,) vector or a (d, k) matrix, got shape {tuple(b.shape)}")
    if not tol > 0:
        raise ValueError(f"tol must be positive, got {tol}")
    if not bool(torch.isfinite(b).all()):
        raise ValueError(f"conjugate_gradient: the right-hand side contains NaN or inf "
                         f"({int((~torch.isfinite(b)).sum())} entries)")
    B = b if b.dim() == 2 else b[:, None]
    d = B.shape[0]
    max_iter = 2 * d if max_iter is None else int(max_iter)
    tol_eff = max(float(tol), 10 * float(torch.finfo(B.dtype).eps))
    X = torch.zeros_like(B) if x0 is None else (x0 if x0.dim() == 2 else x0[:, None]).clone().to(B)
    R = B - matmat(X) if x0 is not None else B.clone()
    bnorm = B.norm(dim=0)
    target = tol_eff * bnorm
    P = R.clone()
    rr = (R * R).sum(0)
    active = R.norm(dim=0) > target
    it = 0
    while bool(active.any()) and it < max_iter:
        cols = active.nonzero()[:, 0]
        Pa = P[:, cols]
        AP = matmat(Pa)
        pAp = (Pa * AP).sum(0)
        if bool((pAp <= 0).any()):
            raise NotPositiveDefiniteError(
                "conjugate gradients met a direction p with p^T A p <= 0 "
                f"(min {float(pAp.min()):.3e}): the operator is not positive definite; "
                "add damping (solve(b, damping=...)) or use a PSD curvature such as the GGN"
            )
        a = rr[cols] / pAp
        X[:, cols] += a * Pa
        R[:, cols] -= a * AP
        rr_new = (R[:, cols] ** 2).sum(0)
        P[:, cols] = R[:, cols] + (rr_new / rr[cols]) * Pa
        rr[cols] = rr_new
        active[cols] = rr_new.sqrt() > target[cols]
        it += 1
    if bool(active.any()):
        rel = (rr.sqrt() / bnorm.clamp_min(torch.finfo(B.dtype).tiny)).max()
        warnings.warn(f"conjugate gradients did not converge in {max_iter} iterations "
                      f"(relative residual {float(rel):.2e} > {tol_eff:.1e}); raise max_iter or add damping",
                      RuntimeWarning, stacklevel=2)
    return X if b.dim() == 2 else X[:, 0]


def shifted_cg(apply: MatMat, B: Tensor, shifts: Tensor, tol: float,
               max_iter: int) -> tuple[Tensor, list[int], list[float]]:
    """Conjugate gradients for k systems (A_j + s_j I) x_j = b_j at once.

    ``apply`` maps the (d, k) matrix [p_1 .. p_k] to [A_1 p_1 .. A_k p_k] (one call per iteration for
    all columns; the A_j may differ, e.g. a full operator and its block-diagonal part), ``shifts`` is
    (k,). Column j stops updating once ||b_j - (A_j + s_j I) x_j|| <= tol ||b_j||. Returns X (d, k), the
    iterations used per column and the final relative residuals (recomputed, not the recursive ones).
    Raises :class:`NotPositiveDefiniteError` on a direction with p^T (A_j + s_j I) p <= 0.
    """
    if B.dim() != 2 or shifts.shape != (B.shape[1],):
        raise ValueError(f"shifted_cg needs B (d, k) and shifts (k,), got {tuple(B.shape)} and "
                         f"{tuple(shifts.shape)}")
    if not bool(torch.isfinite(B).all()) or not bool(torch.isfinite(shifts).all()):
        raise ValueError("shifted_cg: the right-hand sides and shifts must be finite")
    X = torch.zeros_like(B)
    R = B.clone()
    P = R.clone()
    rr = (R * R).sum(0)
    bnorm = B.norm(dim=0)
    active = rr.sqrt() > tol * bnorm
    iters = [0] * B.shape[1]
    tiny = torch.finfo(B.dtype).tiny
    for _ in range(int(max_iter)):
        if not bool(active.any()):
            break
        AP = apply(P) + shifts * P
        pAp = (P * AP).sum(0)
        if bool((pAp[active] <= 0).any()):
            raise NotPositiveDefiniteError("shifted_cg met a direction with p^T A p <= 0: a system is not "
                                           "positive definite; increase its shift")
        alpha = torch.where(active, rr / pAp.clamp_min(tiny), torch.zeros_like(rr))
        X += alpha * P
        R -= alpha * AP
        rr_new = (R * R).sum(0)
        beta = torch.where(active, rr_new / rr.clamp_min(tiny), torch.zeros_like(rr))
        P = torch.where(active, R + beta * P, P)
        rr = torch.where(active, rr_new, rr)
        for j in active.nonzero()[:, 0].tolist():
            iters[j] += 1
        active = active & (rr.sqrt() > tol * bnorm)
    resid = ((B - apply(X) - shifts * X).norm(dim=0) / bnorm.clamp_min(tiny)).tolist()
    return X, iters, resid
