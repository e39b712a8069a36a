"""Lanczos eigenvalues and conjugate gradients (curvkit.linalg.krylov) against dense torch.linalg."""

from __future__ import annotations

import pytest
import torch

from curvkit.linalg.krylov import (
    NotPositiveDefiniteError,
    conjugate_gradient,
    lanczos,
    lanczos_eigenvalues,
    shifted_cg,
)

D64 = torch.float64




def _spectrum_matrix(ev: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(ev.numel(), ev.numel(), generator=g, dtype=ev.dtype))
    return (Q * ev) @ Q.T


def test_lanczos_top_k_matches_eigvalsh():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(60, 60, generator=g, dtype=D64)
    A = A @ A.T / 60
    ref = torch.linalg.eigvalsh(A)
    top = lanczos_eigenvalues(lambda M: A @ M, 60, 5, D64, "cpu", generator=torch.Generator().manual_seed(1))
    assert torch.allclose(top, ref.flip(0)[:5], atol=1e-9, rtol=1e-9)
    assert bool((top[:-1] >= top[1:]).all())  # descending


def test_lanczos_smallest_descending_and_eigenvectors():
    ev = torch.linspace(-3.0, 4.0, 40, dtype=D64)
    A = _spectrum_matrix(ev, 2)
    vals, vecs = lanczos(lambda M: A @ M, 40, 3, D64, "cpu", which="smallest", num_iter=40,
                         generator=torch.Generator().manual_seed(0))
    assert torch.allclose(vals, ev[:3].flip(0), atol=1e-10)
    assert torch.allclose(A @ vecs, vecs * vals, atol=1e-8)
    assert torch.allclose(vecs.T @ vecs, torch.eye(3, dtype=D64), atol=1e-10)


def test_lanczos_finds_repeated_eigenvalues_with_multiplicity():
    # rank-deficient PSD matrix (like a GGN): eigenvalue 0 with multiplicity 20, 2.0 with multiplicity 3
    ev = torch.cat([torch.zeros(20, dtype=D64), torch.full((3,), 2.0, dtype=D64),
                    torch.linspace(3, 5, 7, dtype=D64)])
    A = _spectrum_matrix(ev, 3)
    vals = lanczos_eigenvalues(lambda M: A @ M, 30, 30, D64, "cpu", num_iter=30)
    assert torch.allclose(vals, ev.sort(descending=True).values, atol=1e-9)
    top = lanczos_eigenvalues(lambda M: A @ M, 30, 10, D64, "cpu", num_iter=30)
    assert torch.allclose(top, ev.sort(descending=True).values[:10], atol=1e-9)


def test_lanczos_float32():
    ev = torch.linspace(0.1, 10.0, 50, dtype=D64)
    A = _spectrum_matrix(ev, 4).float()
    top = lanczos_eigenvalues(lambda M: A @ M, 50, 2, torch.float32, "cpu")
    assert top.dtype == torch.float32
    assert torch.allclose(top.double(), ev.flip(0)[:2], rtol=1e-4)


def test_lanczos_bad_arguments():
    A = torch.eye(4, dtype=D64)
    with pytest.raises(ValueError, match="k must"):
        lanczos_eigenvalues(lambda M: A @ M, 4, 5, D64, "cpu")
    with pytest.raises(ValueError, match="which"):
        lanczos_eigenvalues(lambda M: A @ M, 4, 1, D64, "cpu", which="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_iter"):
        lanczos_eigenvalues(lambda M: A @ M, 4, 2, D64, "cpu", num_iter=1)


def test_cg_matches_dense_solve_vector_and_matrix():
    ev = torch.logspace(-2, 1, 30, dtype=D64)
    A = _spectrum_matrix(ev, 5)
    g = torch.Generator().manual_seed(0)
    b = torch.randn(30, generator=g, dtype=D64)
    x = conjugate_gradient(lambda M: A @ M, b, tol=1e-12)
    assert x.shape == (30,)
    assert torch.allclose(x, torch.linalg.solve(A, b), atol=1e-8)
    B = torch.randn(30, 4, generator=g, dtype=D64)
    X = conjugate_gradient(lambda M: A @ M, B, tol=1e-12)
    assert torch.allclose(X, torch.linalg.solve(A, B), atol=1e-8)


def test_cg_not_positive_definite_raises():
    A = torch.diag(torch.tensor([1.0, 2.0, -1.0, 3.0], dtype=D64))
    with pytest.raises(NotPositiveDefiniteError, match="not positive definite"):
        conjugate_gradient(lambda M: A @ M, torch.ones(4, dtype=D64))
    assert issubclass(NotPositiveDefiniteError, ValueError)


def test_cg_warns_when_not_converged():
    A = _spectrum_matrix(torch.logspace(-4, 2, 40, dtype=D64), 6)
    with pytest.warns(RuntimeWarning, match="did not converge"):
        conjugate_gradient(lambda M: A @ M, torch.ones(40, dtype=D64), tol=1e-12, max_iter=3)


def test_cg_bad_rhs_shape():
    with pytest.raises(ValueError, match="right-hand side"):
        conjugate_gradient(lambda M: M, torch.ones(2, 2, 2, dtype=D64))


def test_shifted_cg_matches_direct_solves() -> None:
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    A = M @ M.T  # PSD, rank 5: singular without the shift
    B = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    shifts = torch.tensor([1e-2, 1e-1, 1.0], dtype=torch.float64)
    X, iters, resid = shifted_cg(lambda P: A @ P, B, shifts, tol=1e-12, max_iter=100)
    for j in range(3):
        ref = torch.linalg.solve(A + shifts[j] * torch.eye(12, dtype=torch.float64), B[:, j])
        assert torch.allclose(X[:, j], ref, atol=1e-9)
        assert resid[j] < 1e-10 and 0 < iters[j] <= 12
