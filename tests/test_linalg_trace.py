"""Stochastic trace estimators (curvkit.linalg.trace) on explicit matrices.

Tolerances are derived from the estimators' variance: a Rademacher Hutchinson probe has variance
2 (||A||_F^2 - sum_i A_ii^2), a Gaussian one 2 ||A||_F^2 (both for symmetric A); we accept 4 standard
errors. Seeds are fixed, so every test is deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from curvkit.linalg.trace import hutchinson, hutchinson_values, hutchinson_with_error, hutchpp, probes

D64 = torch.float64




def _psd(d: int, seed: int, decay: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=D64))
    ev = torch.exp(-decay * torch.arange(d, dtype=D64)) if decay else torch.rand(d, generator=g, dtype=D64) + 0.1
    return (Q * ev) @ Q.T


def _sym(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(d, d, generator=g, dtype=D64)
    return (A + A.T) / 2


class Counter:
    """matmat that counts the columns it is applied to and the calls."""

    def __init__(self, A: torch.Tensor):
        self.A, self.columns, self.calls = A, 0, 0

    def __call__(self, M: torch.Tensor) -> torch.Tensor:
        self.columns += M.shape[1]
        self.calls += 1
        return self.A @ M


def test_probes_have_identity_second_moment_and_are_reproducible():
    Z = probes(6, 20000, D64, "cpu", torch.Generator().manual_seed(0), "rademacher")
    assert set(Z.unique().tolist()) == {-1.0, 1.0}
    assert torch.allclose(Z @ Z.T / Z.shape[1], torch.eye(6, dtype=D64), atol=0.03)
    Zg = probes(6, 20000, D64, "cpu", torch.Generator().manual_seed(0), "gaussian")
    assert torch.allclose(Zg @ Zg.T / Zg.shape[1], torch.eye(6, dtype=D64), atol=0.05)
    again = probes(6, 20000, D64, "cpu", torch.Generator().manual_seed(0), "rademacher")
    assert torch.equal(Z, again)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_hutchinson_within_four_standard_errors(distribution):
    A = _sym(40, 1)
    m = 400
    fro2 = float((A**2).sum())
    var = 2 * (fro2 - float((A.diagonal() ** 2).sum())) if distribution == "rademacher" else 2 * fro2
    est = hutchinson(lambda M: A @ M, 40, m, D64, "cpu", generator=torch.Generator().manual_seed(3),
                     distribution=distribution)
    assert est.dim() == 0
    assert abs(float(est) - float(A.trace())) <= 4 * math.sqrt(var / m)


def test_hutchinson_stderr_matches_theory_and_probes_are_blocked():
    A = _psd(30, 2)
    mm = Counter(A)
    m = 300
    est, err = hutchinson_with_error(mm, 30, m, D64, "cpu", generator=torch.Generator().manual_seed(0),
                                     batch_size=64)
    assert mm.columns == m and mm.calls == math.ceil(m / 64)  # blocks of 64 columns
    theory = math.sqrt(2 * (float((A**2).sum()) - float((A.diagonal() ** 2).sum())) / m)
    assert 0.7 * theory < float(err) < 1.3 * theory
    assert abs(float(est) - float(A.trace())) <= 4 * theory


def test_hutchinson_exact_for_diagonal_matrix_with_rademacher():
    A = torch.diag(torch.linspace(-2, 5, 17, dtype=D64))
    est = hutchinson(lambda M: A @ M, 17, 3, D64, "cpu", generator=torch.Generator().manual_seed(0))
    assert torch.allclose(est, A.trace(), atol=1e-12)


def test_hutchinson_tol_stops_early():
    A = _psd(30, 4) + 5 * torch.eye(30, dtype=D64)  # trace dominated by the diagonal: small relative error
    mm = Counter(A)
    est, err = hutchinson_with_error(mm, 30, 10_000, D64, "cpu", generator=torch.Generator().manual_seed(0),
                                     tol=0.01, batch_size=16)
    assert mm.columns < 10_000
    assert float(err) <= 0.01 * abs(float(est))
    vals = hutchinson_values(Counter(A), 30, 10_000, D64, "cpu", generator=torch.Generator().manual_seed(0),
                             tol=0.01, batch_size=16)
    assert vals.numel() == mm.columns  # the number of probes actually used
    assert torch.allclose(vals.mean(), est)
    mm_full = Counter(A)
    hutchinson(mm_full, 30, 64, D64, "cpu", generator=torch.Generator().manual_seed(0), batch_size=16)
    assert mm_full.columns == 64


def test_hutchpp_is_exact_when_sketch_spans_the_space():
    A = _sym(10, 5)
    est = hutchpp(lambda M: A @ M, 10, 30, D64, "cpu", generator=torch.Generator().manual_seed(0))
    assert torch.allclose(est, A.trace(), atol=1e-10)


def test_hutchpp_uses_num_probes_products():
    A = _psd(50, 6, decay=0.2)
    mm = Counter(A)
    hutchpp(mm, 50, 31, D64, "cpu", generator=torch.Generator().manual_seed(0), batch_size=4)
    assert mm.columns == 31


def test_hutchpp_unbiased_and_more_accurate_than_hutchinson_on_decaying_spectrum():
    A = _psd(100, 7, decay=0.3)
    tr = float(A.trace())
    g = torch.Generator().manual_seed(11)
    pp = torch.stack([hutchpp(lambda M: A @ M, 100, 30, D64, "cpu", generator=g) for _ in range(60)])
    hu = torch.stack([hutchinson(lambda M: A @ M, 100, 30, D64, "cpu", generator=g) for _ in range(60)])
    # unbiased: the mean over 60 repetitions lies within 4 empirical standard errors
    assert abs(float(pp.mean()) - tr) <= 4 * float(pp.std()) / math.sqrt(60)
    # Hutch++ removes the top of the spectrum: much smaller mean absolute error at equal products
    assert float((pp - tr).abs().mean()) < 0.5 * float((hu - tr).abs().mean())


def test_bad_arguments():
    A = torch.eye(3, dtype=D64)
    with pytest.raises(ValueError, match="num_probes"):
        hutchinson(lambda M: A @ M, 3, 0, D64, "cpu")
    with pytest.raises(ValueError, match="distribution"):
        hutchinson(lambda M: A @ M, 3, 4, D64, "cpu", distribution="uniform")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 3"):
        hutchpp(lambda M: A @ M, 3, 2, D64, "cpu")
    with pytest.raises(ValueError, match="tol"):
        hutchinson(lambda M: A @ M, 3, 4, D64, "cpu", tol=-1.0)
