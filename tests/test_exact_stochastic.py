"""Monte Carlo and Krylov methods on the exact operators: MC Fisher and Hutchinson/Hutch++ converge to
the exact quantities within tolerances derived from the estimators' variances (fixed seeds); Lanczos,
CG and the scipy export agree with dense torch.linalg / scipy."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import eigsh
from torch import nn

from curvkit.curvature import GGNOperator, HessianOperator, MCFisherOperator
from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian
from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.models import mlp
from reference import dense_ggn, dense_hessian, per_sample_jacobians

D64 = torch.float64




def _setup(lik_name: str, n: int = 4):
    torch.manual_seed(0)
    model = mlp([3, 4, 3], "tanh", dtype=D64)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n, 3, generator=g, dtype=D64)
    if lik_name == "ce":
        lik, y = CrossEntropy("mean"), torch.randint(0, 3, (n,), generator=g)
    elif lik_name == "bce":
        lik, y = BernoulliBCE("mean"), torch.randint(0, 2, (n, 3), generator=g).to(D64)
    else:
        lik, y = Gaussian("mean", sigma=0.8), torch.randn(n, 3, generator=g, dtype=D64)
    return model, lik, (X, y)


def _single_label_variance(model, lik, X) -> torch.Tensor:
    """Entrywise variance of w sum_n u_n u_n^T, u_n = J_n^T g(f_n, y_n), y_n ~ model, ONE label each."""
    J = per_sample_jacobians(model, X)  # (N, C, d)
    f = model(X).detach()
    w = 1.0 / X.shape[0]
    var = torch.zeros(J.shape[2], J.shape[2], dtype=D64)
    for n in range(X.shape[0]):
        if isinstance(lik, Gaussian):  # u ~ N(0, S), S = J^T J / sigma^2: Var(u_i u_j) = S_ii S_jj + S_ij^2
            S = J[n].T @ J[n] / lik.sigma**2
            var += w**2 * (S.diagonal()[:, None] * S.diagonal()[None, :] + S**2)
            continue
        if isinstance(lik, CrossEntropy):
            p = f[n].softmax(-1)
            outcomes = [(float(p[c]), torch.tensor([c])) for c in range(f.shape[1])]
        else:
            s = torch.sigmoid(f[n])
            outcomes = []
            for bits in itertools.product([0.0, 1.0], repeat=f.shape[1]):
                yb = torch.tensor([bits], dtype=D64)
                outcomes.append((float((s**yb[0] * (1 - s) ** (1 - yb[0])).prod()), yb))
        m1 = torch.zeros_like(var)
        m2 = torch.zeros_like(var)
        for prob, yv in outcomes:
            u = J[n].T @ lik.output_grad(f[n:n + 1], yv)[0]
            uu = torch.outer(u, u)
            m1 += prob * uu
            m2 += prob * uu**2
        var += w**2 * (m2 - m1**2)
    return var


@pytest.mark.parametrize("lik_name", ["ce", "bce", "gauss"])
def test_mc_fisher_converges_to_fisher(lik_name):
    """|F_MC - F| <= 5 sqrt(Var / M) entrywise, Var the exact single-label variance (M = 2000 labels)."""
    model, lik, data = _setup(lik_name)
    F = dense_ggn(model, lik, data)  # == type-2 Fisher for these heads
    var = _single_label_variance(model, lik, data[0])
    M = 2000
    F_mc = MCFisherOperator(model, lik, data, mc_samples=M, seed=0).to_dense()
    bound = 5 * (var / M).sqrt() + 1e-12
    assert bool(((F_mc - F).abs() <= bound).all()), float(((F_mc - F).abs() / bound).max())
    # and the error shrinks with M: one label per point is much further off
    F_one = MCFisherOperator(model, lik, data, mc_samples=1, seed=0).to_dense()
    assert torch.linalg.norm(F_mc - F) < 0.2 * torch.linalg.norm(F_one - F)


def test_mc_fisher_diagonal_consistent_with_dense():
    model, lik, data = _setup("ce")
    op = MCFisherOperator(model, lik, data, mc_samples=7, seed=3)
    torch.testing.assert_close(op.diagonal().flat, op.to_dense().diagonal(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("which", ["ggn", "hessian"])
def test_hutchinson_on_operators_within_four_standard_errors(which):
    model, lik, data = _setup("ce", n=6)
    op = GGNOperator(model, lik, data) if which == "ggn" else HessianOperator(model, lik, data)
    A = op.to_dense()
    m = 400
    est = op.trace("hutchinson", num_probes=m, generator=torch.Generator().manual_seed(0))
    se = math.sqrt(2 * (float((A**2).sum()) - float((A.diagonal() ** 2).sum())) / m)
    assert abs(float(est) - float(A.trace())) <= 4 * se
    est_g = op.trace("hutchinson", num_probes=m, generator=torch.Generator().manual_seed(0),
                     distribution="gaussian")
    assert abs(float(est_g) - float(A.trace())) <= 4 * math.sqrt(2 * float((A**2).sum()) / m)


def test_hutchpp_on_ggn():
    model, lik, data = _setup("ce", n=2)  # GGN of rank 4: the Hutch++ sketch captures it exactly
    op = GGNOperator(model, lik, data)
    tr = op.trace()
    torch.testing.assert_close(op.trace("hutch++", num_probes=18, generator=torch.Generator().manual_seed(0)),
                               tr, atol=1e-10, rtol=0)
    torch.testing.assert_close(op.trace("hutch++", num_probes=3 * op.layout.dim), tr, atol=1e-10, rtol=0)


def test_lanczos_on_operators():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(18, 3)).to(D64)  # d = 77
    g = torch.Generator().manual_seed(3)
    X = torch.randn(8, 1, 5, 5, generator=g, dtype=D64)
    data = (X, torch.randint(0, 3, (8,), generator=g))
    lik = CrossEntropy("sum")
    G_op, H_op = GGNOperator(model, lik, data), HessianOperator(model, lik, data)
    ref_G = torch.linalg.eigvalsh(dense_ggn(model, lik, data))
    ref_H = torch.linalg.eigvalsh(dense_hessian(model, lik, data))
    gen = torch.Generator().manual_seed(0)
    torch.testing.assert_close(G_op.eigenvalues(4, generator=gen), ref_G.flip(0)[:4], atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(H_op.eigenvalues(3, generator=gen), ref_H.flip(0)[:3], atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(H_op.eigenvalues(2, which="smallest", generator=gen), ref_H[:2].flip(0),
                               atol=1e-8, rtol=1e-8)
    assert float(ref_H[0]) < -1e-6  # the tanh Hessian is indefinite: the smallest-eigenvalue check matters


def test_solve_with_damping_and_not_pd_error():
    model, lik, data = _setup("ce", n=6)
    G_op, H_op = GGNOperator(model, lik, data), HessianOperator(model, lik, data)
    G = G_op.to_dense()
    b = torch.randn(G_op.layout.dim, generator=torch.Generator().manual_seed(0), dtype=D64)
    eye = torch.eye(G.shape[0], dtype=D64)
    x = G_op.solve(b, damping=0.1)
    torch.testing.assert_close(x, torch.linalg.solve(G + 0.1 * eye, b), atol=1e-8, rtol=0)
    B = torch.randn(G.shape[0], 3, dtype=D64)
    torch.testing.assert_close(G_op.solve(B, damping=0.1), torch.linalg.solve(G + 0.1 * eye, B), atol=1e-8, rtol=0)
    xl = G_op.solve(G_op.layout.unflatten(b), damping=0.1)
    torch.testing.assert_close(G_op.layout.flatten(xl), x, atol=1e-10, rtol=0)
    H = H_op.to_dense()
    assert float(torch.linalg.eigvalsh(H)[0]) < 0
    with pytest.raises(NotPositiveDefiniteError, match="not positive definite"):
        H_op.solve(b)


def test_scipy_export_eigsh():
    model, lik, data = _setup("bce", n=5)
    op = GGNOperator(model, lik, data)
    ref = torch.linalg.eigvalsh(op.to_dense()).flip(0)[:3].numpy()
    vals = np.sort(eigsh(op.to_scipy(), k=3, which="LA", return_eigenvectors=False))[::-1]
    assert np.allclose(vals, ref, atol=1e-10)
    v = np.ones(op.layout.dim)
    assert np.allclose(op.to_scipy() @ v, (op @ torch.ones(op.layout.dim, dtype=D64)).numpy(), atol=1e-12)
