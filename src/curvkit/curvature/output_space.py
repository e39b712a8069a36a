"""Output-space Fisher F_L of a likelihood head, computed from its DEFINITION (thesis Eq. 3.36).

    F_L(f) = E_{y ~ p(y | f)} [ g(f, y) g(f, y)^T ],   g(f, y) = d(-log p(y | f)) / df   (per sample)

The type-2 Fisher of the parameters is then F_theta = sum_n J_n^T F_L(f_n) J_n (thesis Eq. 3.36), with
J_n = df_n / dtheta. :func:`output_fisher_sqrt` returns a factor S (B, C, R) with S S^T = F_L:

* softmax cross-entropy, p = softmax(f): g(f, c) = p - e_c, so F_L = sum_c p_c (p - e_c)(p - e_c)^T and
  S[:, :, c] = sqrt(p_c) (p - e_c) (R = K columns: the expectation over the K classes, written out).
* independent sigmoid Bernoulli, s = sigmoid(f): g = s - y with y_i ~ Bernoulli(s_i) independent, so
  E[g_i g_j] = 0 for i != j and E[g_i^2] = Var(y_i) = s_i (1 - s_i): F_L = diag(s (1 - s)), S = diag(sqrt(.)).
* Gaussian with fixed std sigma: y = f + sigma eps, g = (f - y) / sigma^2 = -eps / sigma, so
  F_L = E[eps eps^T] / sigma^2 = I / sigma^2 and S = I / sigma.

For these natural-parameter exponential-family heads F_L equals the output Hessian H_L (thesis Eqs.
3.37-3.38: -d^2 log p / d eta^2 = d^2 log Z / d eta^2 does not depend on y), so the type-2 Fisher equals
the GGN; the tests check this numerically rather than assuming it (the GGN uses the likelihood's own
``output_hessian_sqrt``). Each likelihood owns its closed forms (``Likelihood.output_fisher_sqrt_columns``, ``output_fisher_matvec``,
``output_fisher_rank``); another head can take part by defining ``output_fisher_sqrt(f)`` itself.

Products without (C, C). :func:`output_fisher_matvec` applies F_L to vectors in O(C) per position, from the
same definition: for softmax, sum_c p_c (p - e_c)(p - e_c)^T v = p * v - p (p^T v) (expand the sum with
sum_c p_c = 1), for the sigmoid s (1 - s) * v, for the Gaussian v / sigma^2; a custom head's factor S is
applied as S (S^T v). :func:`output_fisher_sqrt_columns` gives a chunk of the columns of S (the exact
diagonal and the dense matrix take S column by column, one backward pass per column). Outputs may have
position dimensions, f (B, *P, C): every quantity here is per position. :func:`reduced_factor` forms
S S^T per position and is only for small C (at most ``SMALL_C`` outputs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from curvkit.likelihoods import Likelihood

#: ``reduced_factor`` (which forms S S^T per position) is used only up to this many outputs
SMALL_C = 64


def output_fisher_sqrt(likelihood: Likelihood, f: Tensor) -> Tensor:
    """(..., C, R) factor S of the per-position output Fisher F_L = E_{y~model}[g g^T] (see module doc).

    Holds C x R numbers per position: for many classes use :func:`output_fisher_matvec` (products) or
    :func:`output_fisher_sqrt_columns` (chunks of columns)."""
    return output_fisher_sqrt_columns(likelihood, f, slice(None))


def output_fisher_rank(likelihood: Likelihood, f: Tensor) -> int:
    """R, the number of columns of :func:`output_fisher_sqrt` (C for the built-in heads)."""
    return likelihood.output_fisher_rank(f)


def output_fisher_sqrt_columns(likelihood: Likelihood, f: Tensor, cols: slice) -> Tensor:
    """(..., C, r) the columns ``cols`` (a slice of range(R)) of :func:`output_fisher_sqrt`, without
    forming the other columns (softmax: column c is sqrt(p_c) (p - e_c), the expectation written out)."""
    return likelihood.output_fisher_sqrt_columns(f, cols)


def output_fisher_matvec(likelihood: Likelihood, f: Tensor, V: Tensor) -> Tensor:
    """F_L V per position in O(C R) (O(C) for the built-in heads; never a (C, C) matrix): V (*K, ..., C)
    broadcasts against f (..., C) (module doc for the closed forms)."""
    return likelihood.output_fisher_matvec(f, V)


def output_fisher(likelihood: Likelihood, f: Tensor) -> Tensor:
    """(..., C, C) per-position output Fisher F_L = S S^T (small C only)."""
    S = output_fisher_sqrt(likelihood, f)
    return S @ S.transpose(-1, -2)


def reduced_factor(S: Tensor) -> Tensor:
    """A factor S' (B, C, R') with S' S'^T = S S^T per sample and R' <= R: output directions that are null
    for EVERY sample of the batch are dropped.

    Per sample, S S^T = U diag(lam) U^T (``eigh``); S' keeps the columns U_j sqrt(lam_j) whose eigenvalue
    exceeds C * eps(dtype) * max(lam) for at least one sample (the others are zero up to rounding). For
    softmax cross-entropy the all-ones vector is always null (diag(p) - p p^T) 1 = 0, so R' = C - 1; the
    exact diagonal and the dense matrix then need one backward pass / factor row fewer per sample.
    Returns S itself when nothing can be dropped, and also when ``eigh`` fails or returns NaN/inf in S's dtype
    and in float64 (LAPACK can, on the near-zero, repeated eigenvalues of saturated softmax outputs): dropping
    directions is only a saving, so S is always a correct answer. It forms the (B, C, C) products S S^T: the
    exact operators call it only for C <= ``SMALL_C`` (larger heads take the columns of S in chunks).
    """
    if S.dim() != 3 or S.shape[1] < 2:
        return S
    M = S @ S.transpose(-1, -2)
    for dtype in dict.fromkeys((S.dtype, torch.float64)):
        try:
            lam, U = torch.linalg.eigh(M.to(dtype))
        except RuntimeError:  # torch.linalg.LinAlgError
            continue
        if bool(torch.isfinite(lam).all()) and bool(torch.isfinite(U).all()):
            lam, U = lam.to(S.dtype), U.to(S.dtype)
            break
    else:
        return S
    tol = S.shape[1] * torch.finfo(S.dtype).eps * lam[:, -1:].clamp_min(0)
    keep = (lam > tol).any(0)
    if int(keep.sum()) >= S.shape[2]:
        return S
    return U[:, :, keep] * lam[:, keep].clamp_min(0).sqrt()[:, None, :]
