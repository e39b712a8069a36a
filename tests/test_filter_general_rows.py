"""The corrected Eq. 24 for per-example gradients of any rank (``kron_math.project_first_order_rows``): example n's
gradient matrix E_n = L_n^T R_n from T rows (a Linear layer shared over positions, a convolution's locations, a
tied weight's stacked uses). Against the rank-one step at T = 1, against the exact KL projection of the dense
Kalman update (the first-order error is second order in the update), and where the exact posterior stays
Kronecker. Float64."""

from __future__ import annotations

import itertools

import pytest
import torch

from curvkit.optim.filters.kron_math import (
    kl_project,
    project_first_order,
    project_first_order_batched,
    project_first_order_rows,
    rows_kron_vec,
)
from reference import first_order_data_step

DT = torch.float64


def _spd(n: int, g: torch.Generator) -> torch.Tensor:
    A = torch.randn(n, n, generator=g, dtype=DT)
    return A @ A.T / n + 0.5 * torch.eye(n, dtype=DT)


def _kalman(Sx: torch.Tensor, Sd: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """The dense rank-one Kalman covariance update of Sigma = Sx (x) Sd with the Fisher sample e (column-stacking)."""
    S = torch.kron(Sx, Sd)
    Se = S @ e
    return S - torch.outer(Se, Se) / (1.0 + e @ Se)


@pytest.mark.parametrize("sequential", [True, False])
def test_one_row_per_example_is_the_rank_one_step(sequential):
    """T = 1: E_n = delta_n x_n^T, the existing corrected Eq. 24 (per sample, or the batched sum) to 1e-12."""
    g = torch.Generator().manual_seed(0)
    N, M, K = 5, 4, 6
    Sx, Sd = _spd(N, g), _spd(M, g)
    X, D = torch.randn(K, N, generator=g, dtype=DT), torch.randn(K, M, generator=g, dtype=DT)
    got = project_first_order_rows(Sx, Sd, D[:, None, :], X[:, None, :], sequential)
    if sequential:
        want = (Sx, Sd)
        for x, d in zip(X, D):
            want = project_first_order(*want, x, d)
    else:
        want = project_first_order_batched(Sx, Sd, X, D)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_first_order_step_is_the_exact_projection_to_first_order():
    """E = sqrt(h) L^T R with T = 3 rows (rank 3 > 1): ||kron(first order) - kron(exact KL projection of the dense
    Kalman update)|| is O(h^2) (h: the size of the update e e^T), so halving h divides it by about 4 (a wrong
    first-order term would give 2); the same in E's scale: halving E divides it by about 16."""
    g = torch.Generator().manual_seed(1)
    N, M, T = 3, 4, 3
    Sx, Sd = _spd(N, g), _spd(M, g)
    L, R = torch.randn(1, T, M, generator=g, dtype=DT), torch.randn(1, T, N, generator=g, dtype=DT)
    assert int(torch.linalg.matrix_rank(L[0].T @ R[0])) == 3
    errs = []
    for h in (4e-3, 2e-3, 1e-3, 5e-4):
        Lh = L * h**0.5
        exact = torch.kron(*kl_project(_kalman(Sx, Sd, rows_kron_vec(Lh, R)[0]), N, M, init=(Sx, Sd), iters=5000,
                                       tol=1e-15))
        first = torch.kron(*project_first_order_rows(Sx, Sd, Lh, R))
        zeroth = torch.linalg.norm(exact - torch.kron(Sx, Sd))
        errs.append(float(torch.linalg.norm(exact - first)))
        assert errs[-1] < 0.05 * float(zeroth)  # far below the update itself
    ratios = [a / b for a, b in itertools.pairwise(errs)]
    assert all(3.7 < r < 4.3 for r in ratios), (errs, ratios)


@pytest.mark.parametrize("side", ["one output", "one input"])
def test_where_the_exact_posterior_stays_kronecker(side):
    """One output (M = 1) or one input (N = 1): E_n = L_n^T R_n has rank one whatever T (a row or a column), the
    dense Kalman update stays Kronecker (its exact KL projection reproduces it), and the rows' step equals the
    rank-one step with x = E^T, delta = [1] (or x = [1], delta = E)."""
    g = torch.Generator().manual_seed(2)
    N, M, T = (4, 1, 3) if side == "one output" else (1, 4, 3)
    Sx, Sd = _spd(N, g), _spd(M, g)
    L, R = torch.randn(2, T, M, generator=g, dtype=DT), torch.randn(2, T, N, generator=g, dtype=DT)
    e = rows_kron_vec(L, R)[0]
    dense = _kalman(Sx, Sd, e)
    torch.testing.assert_close(torch.kron(*kl_project(dense, N, M, init=(Sx, Sd))), dense, rtol=0, atol=1e-12)
    want = (Sx, Sd)
    for Ln, Rn in zip(L, R):
        E = Ln.T @ Rn
        x, d = (E[0], E.new_ones(1)) if M == 1 else (E.new_ones(1), E[:, 0])
        want = project_first_order(*want, x, d)
    for a, b in zip(project_first_order_rows(Sx, Sd, L, R), want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_bad_shapes_are_refused():
    Sx, Sd = torch.eye(3, dtype=DT), torch.eye(2, dtype=DT)
    with pytest.raises(ValueError, match=r"must be \(K, T, M\) and \(K, T, N\)"):
        project_first_order_rows(Sx, Sd, torch.zeros(2, 2, dtype=DT), torch.zeros(2, 1, 3, dtype=DT))
    with pytest.raises(ValueError, match="M = 2 and N = 3"):
        project_first_order_rows(Sx, Sd, torch.zeros(2, 1, 3, dtype=DT), torch.zeros(2, 1, 2, dtype=DT))


@pytest.mark.parametrize("sequential", [True, False])
@pytest.mark.parametrize("T", [2, 7])
def test_the_rows_step_equals_the_formula_in_e(T, sequential):
    """Against the step written from E_n itself, Sx' = Sx + (s/(2NM) Sx - Sx E^T Sd E Sx / M) / D (and Sd'), for
    few rows (the T x T route) and more rows than min(M, N) (E formed and refactorised)."""
    g = torch.Generator().manual_seed(3)
    N, M, K = 5, 4, 3
    Sx, Sd = _spd(N, g), _spd(M, g)
    L, R = torch.randn(K, T, M, generator=g, dtype=DT), torch.randn(K, T, N, generator=g, dtype=DT)
    Sx_r, Sd_r = first_order_data_step(Sx, Sd, [Ln.T @ Rn for Ln, Rn in zip(L, R)], sequential)
    got = project_first_order_rows(Sx, Sd, L, R, sequential)
    torch.testing.assert_close(got[0], Sx_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], Sd_r, rtol=0, atol=1e-12)
