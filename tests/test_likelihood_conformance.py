"""Conformance of every likelihood (issue 32: a new likelihood is one class plus this test): what the curvature
engine asks of it is consistent with its dense per-position output Hessian, padding included (float64; 1e-10).

Add a new likelihood to ``CASES`` with outputs and targets of its kind."""

from __future__ import annotations

import pytest
import torch

from curvkit.likelihoods import BernoulliBCE, BernoulliMixture, CrossEntropy, Gaussian

D64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)


def _case(name: str):
    g = torch.Generator().manual_seed(0)
    if name.startswith("ce"):
        f = torch.randn(4, 3, 5, generator=g, dtype=D64)
        y = torch.randint(0, 5, (4, 3), generator=g)
        if name == "ce-pad":
            y[0, 2] = y[3, 0] = -100
            return CrossEntropy("sum", ignore_index=-100), f, y
        return CrossEntropy("mean"), f, y
    if name.startswith("bce"):
        f = torch.randn(4, 3, 5, generator=g, dtype=D64)
        y = torch.randint(0, 2, (4, 3, 5), generator=g).to(D64)
        if name == "bce-pad":
            y[1, 1] = -1.0
            return BernoulliBCE("sum", ignore_value=-1.0), f, y
        return BernoulliBCE(), f, y
    if name == "gaussian":
        return Gaussian("sum", sigma=0.7), torch.randn(4, 6, generator=g, dtype=D64), torch.randn(4, 6, generator=g,
                                                                                                   dtype=D64)
    return BernoulliMixture(), torch.randn(6, 3, generator=g, dtype=D64), torch.randint(0, 2, (6,), generator=g)


CASES = ["ce", "ce-pad", "bce", "bce-pad", "gaussian", "mixture"]


@pytest.mark.parametrize("name", CASES)
def test_output_space_quantities_agree_with_the_dense_output_hessian(name):
    lik, f, y = _case(name)
    H = lik.output_hessian(f, y)  # (..., C, C), zero at padded positions
    C = f.shape[-1]
    torch.testing.assert_close(lik.output_hessian_sum(f, y), H.reshape(-1, C, C).sum(0), **TOL)
    torch.testing.assert_close(lik.output_hessian_diagonal(f, y), H.diagonal(dim1=-2, dim2=-1), **TOL)
    if not lik.hessian_needs_target:  # products in O(C) per position
        V = torch.randn(2, *f.shape, generator=torch.Generator().manual_seed(1), dtype=D64)
        torch.testing.assert_close(lik.output_hessian_matvec(f, V, y), torch.einsum("...cd,k...d->k...c", H, V),
                                   **TOL)
    S = lik.output_hessian_sqrt(f, y)
    assert S.shape[-1] == lik.sqrt_rank(f)
    if name != "mixture":  # the mixture's square root is of its (PSD) Fisher surrogate, not of H_exact
        torch.testing.assert_close(S @ S.transpose(-1, -2), H, **TOL)
    # sampled targets are valid targets and keep the padding of y
    z = lik.sample(f, torch.Generator().manual_seed(2), y)
    lik.check(f, z)
    keep = lik.mask(y)
    if keep is not None:
        assert torch.equal(z[~keep], y[~keep])
