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
``output_hessian_sqrt``). Another head can take part by defining ``output_fisher_sqrt(f)`` itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian, Likelihood


def output_fisher_sqrt(likelihood: Likelihood, f: Tensor) -> Tensor:
    """(..., C, R) factor S of the per-position output Fisher F_L = E_{y~model}[g g^T] (see module doc)."""
    if isinstance(likelihood, CrossEntropy):
        p = f.softmax(-1)  # (..., K)
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        grads = p[..., :, None] - eye  # column c: g(f, c) = p - e_c
        return grads * p.sqrt()[..., None, :]
    if isinstance(likelihood, BernoulliBCE):
        s = torch.sigmoid(f)
        return torch.diag_embed((s * (1 - s)).sqrt())
    if isinstance(likelihood, Gaussian):
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        return eye.expand(*f.shape, f.shape[-1]) / likelihood.sigma
    custom = getattr(likelihood, "output_fisher_sqrt", None)
    if callable(custom):
        out: Tensor = custom(f)
        return out
    raise TypeError(
        f"no closed-form output Fisher for {type(likelihood).__name__}; define an "
        "output_fisher_sqrt(f) method on it, or use MCFisherOperator (sampled labels) instead"
    )


def output_fisher(likelihood: Likelihood, f: Tensor) -> Tensor:
    """(B, C, C) per-sample output Fisher F_L = S S^T."""
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
    directions is only a saving, so S is always a correct answer.
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
