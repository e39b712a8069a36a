"""Stochastic trace estimators for a symmetric operator given only by matrix-matrix products.

Both estimators take ``matmat``: a function (d, k) -> (d, k) applying the operator A to k columns at once.
Probes are drawn and applied in blocks of ``batch_size`` columns, never one by one.

* :func:`hutchinson` (Hutchinson 1989): tr(A) ~ (1/m) sum_i z_i^T A z_i with E[z z^T] = I. Rademacher
  probes (entries +-1) have variance 2 (||A||_F^2 - sum_i A_ii^2) per probe, Gaussian probes 2 ||A||_F^2.
  :func:`hutchinson_with_error` also returns the standard error of the mean over probes, and
  :func:`hutchinson_values` the per-probe values themselves (how many were used after an early stop).
* :func:`hutchpp` (Meyer, Musco, Musco & Woodruff 2021, "Hutch++: optimal stochastic trace estimation"):
  spend m/3 products on a sketch A S, project out its range Q, take tr(Q^T A Q) exactly (m/3 products)
  and estimate the trace of the deflated remainder (I - QQ^T) A (I - QQ^T) by Hutchinson with the last
  m/3 products. Relative error O(1/m) instead of O(1/sqrt(m)) for PSD A with decaying spectrum.

Seeds: pass a ``torch.Generator`` for reproducible probes. Probes are sampled on the generator's device
(CPU for the default generator) and then moved to ``device``, so the same seed gives the same probes on
CPU and GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

MatMat = Callable[[Tensor], Tensor]
QuadForm = Callable[[Tensor], Tensor]
Distribution = Literal["rademacher", "gaussian"]

DEFAULT_BATCH_SIZE = 32


def _check_args(d: int, num_probes: int, batch_size: int | None, distribution: str) -> int:
    if int(d) < 1:
        raise ValueError(f"operator dimension d must be positive, got {d}")
    if int(num_probes) < 1:
        raise ValueError(f"num_probes must be a positive integer, got {num_probes}")
    if distribution not in ("rademacher", "gaussian"):
        raise ValueError(f"unknown probe distribution {distribution!r}; use 'rademacher' or 'gaussian'")
    bs = DEFAULT_BATCH_SIZE if batch_size is None else int(batch_size)
    if bs < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    return bs


def probes(
    d: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    distribution: Distribution = "rademacher",
) -> Tensor:
    """A (d, k) block of random probes with E[z z^T] = I (Rademacher +-1 or standard Gaussian).

    The block is the transpose of a row-major (k, d) draw (probe after probe), so each probe is contiguous
    in memory: operators that split a column into parameter tensors then need no copy.
    """
    gen_device = generator.device if generator is not None else torch.device("cpu")
    if distribution == "rademacher" and gen_device.type == "cpu" and dtype.is_floating_point:
        # drawn directly in the floating dtype: on CPU the same numbers as the int64 draw below, without
        # the int64 temporary and two extra passes
        Z = torch.randint(0, 2, (k, d), generator=generator, device=gen_device, dtype=dtype).mul_(2).sub_(1)
    elif distribution == "rademacher":
        Z = torch.randint(0, 2, (k, d), generator=generator, device=gen_device).to(dtype) * 2 - 1
    elif distribution == "gaussian":
        Z = torch.randn(k, d, generator=generator, device=gen_device, dtype=dtype)
    else:
        raise ValueError(f"unknown probe distribution {distribution!r}; use 'rademacher' or 'gaussian'")
    return Z.to(device=device, dtype=dtype).T


def _apply(matmat: MatMat, M: Tensor, batch_size: int) -> Tensor:
    """matmat applied to the columns of M in blocks of at most ``batch_size`` columns."""
    if M.shape[1] <= batch_size:
        return matmat(M)
    return torch.cat([matmat(M[:, s:s + batch_size]) for s in range(0, M.shape[1], batch_size)], dim=1)


def hutchinson_values(
    matmat: MatMat,
    d: int,
    num_probes: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    distribution: Distribution = "rademacher",
    tol: float | None = None,
    batch_size: int | None = None,
    quadform: QuadForm | None = None,
) -> Tensor:
    """The per-probe values z_i^T A z_i, shape (m,), with m <= ``num_probes`` probes actually used.

    Probes are drawn in blocks of ``batch_size`` (default 32) columns. With ``tol`` the loop stops after
    the first block at which the standard error of the running mean is <= tol * |mean| (at least two
    probes), so m may be smaller than ``num_probes``. ``quadform`` (optional): a function (d, k) -> (k,)
    returning z_i^T A z_i directly, used instead of ``(Z * matmat(Z)).sum(0)`` when the operator has a
    cheaper quadratic form (e.g. ||S^T J z||^2 for a GGN: no backward pass).
    """
    bs = _check_args(d, num_probes, batch_size, distribution)
    if tol is not None and not tol > 0:
        raise ValueError(f"tol must be positive (a relative standard error), got {tol}")
    values: list[Tensor] = []
    done = 0
    while done < num_probes:
        k = min(bs, num_probes - done)
        Z = probes(d, k, dtype, device, generator, distribution)
        values.append(quadform(Z) if quadform is not None else (Z * matmat(Z)).sum(0))
        done += k
        if tol is not None and done >= 2:
            mean, err = _mean_stderr(torch.cat(values))
            if bool(err <= tol * mean.abs()):
                break
    return torch.cat(values)


def hutchinson_with_error(
    matmat: MatMat,
    d: int,
    num_probes: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    distribution: Distribution = "rademacher",
    tol: float | None = None,
    batch_size: int | None = None,
    quadform: QuadForm | None = None,
) -> tuple[Tensor, Tensor]:
    """Hutchinson estimate of tr(A) and its standard error, as two 0-d tensors.

    The mean of the per-probe values of :func:`hutchinson_values` (same arguments) and its standard
    error s / sqrt(m) (s = sample standard deviation of the m values; NaN when m = 1). Use
    :func:`hutchinson_values` directly to learn how many probes an early stop (``tol``) used.
    """
    return _mean_stderr(hutchinson_values(matmat, d, num_probes, dtype, device, generator=generator,
                                          distribution=distribution, tol=tol, batch_size=batch_size,
                                          quadform=quadform))


def _mean_stderr(v: Tensor) -> tuple[Tensor, Tensor]:
    m = v.numel()
    mean = v.mean()
    if m < 2:
        return mean, torch.full((), math.nan, dtype=v.dtype, device=v.device)
    return mean, v.std(unbiased=True) / math.sqrt(m)


def hutchinson(
    matmat: MatMat,
    d: int,
    num_probes: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    distribution: Distribution = "rademacher",
    tol: float | None = None,
    batch_size: int | None = None,
    quadform: QuadForm | None = None,
) -> Tensor:
    """Hutchinson estimate of tr(A) (a 0-d tensor); see :func:`hutchinson_values` for the arguments.

    >>> A = torch.diag(torch.arange(1.0, 5.0, dtype=torch.float64))
    >>> float(hutchinson(lambda M: A @ M, 4, 8, torch.float64, "cpu"))  # Rademacher: exact for diagonal A
    10.0
    """
    return hutchinson_with_error(matmat, d, num_probes, dtype, device, generator=generator,
                                 distribution=distribution, tol=tol, batch_size=batch_size,
                                 quadform=quadform)[0]


def hutchpp(
    matmat: MatMat,
    d: int,
    num_probes: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    distribution: Distribution = "rademacher",
    batch_size: int | None = None,
) -> Tensor:
    """Hutch++ estimate of tr(A) with ``num_probes`` = m >= 3 products (Meyer et al. 2021, Algorithm 1).

    With k = m // 3 sketch columns S (d, k) and m - 2k Hutchinson probes G:
    Q = orth(A S); tr(A) ~ tr(Q^T A Q) + tr(G^T (I - QQ^T) A (I - QQ^T) G) / (m - 2k).
    If k >= d the sketch spans the whole space and the result is exact up to rounding.
    """
    bs = _check_args(d, num_probes, batch_size, distribution)
    if num_probes < 3:
        raise ValueError(f"hutch++ needs at least 3 products (num_probes >= 3), got {num_probes}")
    k = num_probes // 3
    S = probes(d, k, dtype, device, generator, distribution)
    Q, _ = torch.linalg.qr(_apply(matmat, S, bs))  # (d, min(d, k))
    exact_part = (Q * _apply(matmat, Q, bs)).sum()
    g = num_probes - 2 * k
    G = probes(d, g, dtype, device, generator, distribution)
    G = G - Q @ (Q.T @ G)
    residual_part = (G * _apply(matmat, G, bs)).sum() / g
    return exact_part + residual_part


def hutchinson_diagonal(
    matmat: MatMat,
    d: int,
    num_probes: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    distribution: Distribution = "rademacher",
    batch_size: int | None = None,
) -> Tensor:
    """Stochastic estimate of diag(A), shape (d,): (1/m) sum_i z_i * (A z_i) (Bekas, Kokiopoulou & Saad
    2007). Unbiased for E[z z^T] = I; with Rademacher probes the error of entry j has variance
    (1/m) sum_{k != j} A_jk^2 (exact for a diagonal A)."""
    bs = _check_args(d, num_probes, batch_size, distribution)
    acc = torch.zeros(d, dtype=dtype, device=device)
    done = 0
    while done < num_probes:
        k = min(bs, num_probes - done)
        Z = probes(d, k, dtype, device, generator, distribution)
        acc += (Z * matmat(Z)).sum(1)
        done += k
    return acc / num_probes


def slq_logdet(
    matmat: MatMat,
    d: int,
    num_probes: int,
    num_iter: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Stochastic Lanczos quadrature estimate of log det(A) = tr(log A) for symmetric positive definite A
    (Ubaru, Chen & Saad 2017): for each Rademacher probe z, ``num_iter`` Lanczos steps from z/||z|` give
    a tridiagonal T = U diag(theta) U^T and z^T log(A) z ~ ||z||^2 sum_k U_0k^2 log(theta_k).

    Returns (estimate, standard error over probes) as 0-d tensors. Raises ValueError if a Ritz value is
    not positive (A is not positive definite). Each probe costs ``num_iter`` products (full
    reorthogonalisation, memory d * num_iter).
    """
    _check_args(d, num_probes, None, "rademacher")
    m = min(int(num_iter), d)
    if m < 1:
        raise ValueError(f"num_iter must be a positive integer, got {num_iter}")
    values = []
    for _ in range(int(num_probes)):
        z = probes(d, 1, dtype, device, generator, "rademacher")[:, 0]
        nz2 = float(z @ z)
        q = z / math.sqrt(nz2)
        V = torch.zeros(d, m, dtype=dtype, device=device)
        alpha = torch.zeros(m, dtype=dtype, device=device)
        beta = torch.zeros(m, dtype=dtype, device=device)
        j = 0
        while j < m:
            V[:, j] = q
            w = matmat(q[:, None])[:, 0]
            alpha[j] = q @ w
            Vj = V[:, :j + 1]
            w = w - Vj @ (Vj.T @ w)
            w = w - Vj @ (Vj.T @ w)
            b = w.norm()
            j += 1
            if j == m or b <= 1e3 * torch.finfo(dtype).eps * alpha[:j].abs().max():
                break
            beta[j - 1] = b
            q = w / b
        T = torch.diag(alpha[:j]) + torch.diag(beta[:j - 1], 1) + torch.diag(beta[:j - 1], -1)
        theta, U = torch.linalg.eigh(T)
        if not bool((theta > 0).all()):
            raise ValueError(f"log-determinant: the operator is not positive definite (Ritz value "
                             f"{float(theta.min()):.3g}); add damping")
        values.append(nz2 * (U[0] ** 2 * theta.log()).sum())
    return _mean_stderr(torch.stack(values) if len(values) > 1 else values[0].reshape(1))
