"""Likelihood heads: per-sample NLL, output gradient, output Hessian and its square root against autograd;
model-label samplers in expectation; validation errors."""

import math

import pytest
import torch
from torch.func import grad, hessian, vmap

from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian, get_likelihood

pytestmark = pytest.mark.usefixtures("float64_default")

B, C = 6, 4


def _data(lik, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(B, C, generator=g)
    if isinstance(lik, CrossEntropy):
        y = torch.randint(0, C, (B,), generator=g)
    elif isinstance(lik, BernoulliBCE):
        y = torch.rand(B, C, generator=g).round()
    else:
        y = torch.randn(B, C, generator=g)
    return f, y


LIKS = [CrossEntropy(), BernoulliBCE(), Gaussian(sigma=0.7), Gaussian(reduction="sum")]


@pytest.mark.parametrize("lik", LIKS, ids=repr)
def test_grad_hessian_sqrt_against_autograd(lik):
    f, y = _data(lik)

    def per(fi, yi):
        return lik.nll_per_sample(fi[None], yi[None])[0]

    g_ref = vmap(grad(per))(f, y)
    H_ref = vmap(hessian(per))(f, y)
    torch.testing.assert_close(lik.output_grad(f, y), g_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lik.output_hessian(f), H_ref, atol=1e-12, rtol=0)
    S = lik.output_hessian_sqrt(f)
    torch.testing.assert_close(S @ S.transpose(1, 2), H_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lik.output_hessian_diagonal(f), H_ref.diagonal(dim1=1, dim2=2), atol=1e-12,
                               rtol=0)


@pytest.mark.parametrize("lik", LIKS, ids=repr)
def test_reduction(lik):
    f, y = _data(lik)
    per = lik.nll_per_sample(f, y)
    expected = per.sum() if lik.reduction == "sum" else per.mean()
    torch.testing.assert_close(lik.nll(f, y), expected)


def test_cross_entropy_matches_torch():
    f, y = _data(CrossEntropy())
    torch.testing.assert_close(CrossEntropy().nll(f, y), torch.nn.functional.cross_entropy(f, y))


def test_softmax_hessian_rank_is_k_minus_one():
    f, _ = _data(CrossEntropy())
    ranks = torch.linalg.matrix_rank(CrossEntropy().output_hessian(f))
    assert (ranks == C - 1).all()


@pytest.mark.parametrize("lik", [CrossEntropy(), BernoulliBCE(), Gaussian(sigma=0.5)], ids=repr)
def test_output_fisher_from_samples_matches_hessian(lik):
    """E_{y ~ model}[g g^T] = H_L (thesis Eqs. 3.36-3.38); Monte Carlo with 40k samples, fixed seed.

    Each entry of the MC average has standard deviation below ~ max|g|^2 / sqrt(n) <= 4 / 200 for these
    heads at unit-scale logits; a tolerance of 0.03 (absolute, relative to entries of size <= 4) holds.
    """
    f, _ = _data(lik, seed=1)
    n = 40_000
    gen = torch.Generator().manual_seed(0)
    fr = f.repeat(n, 1)
    ys = lik.sample(fr, generator=gen)
    g = lik.output_grad(fr, ys).reshape(n, B, C)
    F_mc = torch.einsum("nbi,nbj->bij", g, g) / n
    tol = 0.03 * (1 / lik.sigma**2 if isinstance(lik, Gaussian) else 1)
    torch.testing.assert_close(F_mc, lik.output_hessian(f), atol=tol, rtol=0)


def test_gaussian_normaliser():
    lik = Gaussian(sigma=2.0, include_normaliser=True)
    f, y = torch.zeros(1, 3), torch.zeros(1, 3)
    assert math.isclose(float(lik.nll_per_sample(f, y)[0]), 1.5 * math.log(2 * math.pi * 4))


def test_validation_errors():
    ce = CrossEntropy()
    f = torch.randn(3, 4)
    with pytest.raises(ValueError, match="NaN or inf"):
        ce.nll(torch.tensor([[0.0, float("nan")]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="integer class indices"):
        ce.nll(f, torch.zeros(3))
    with pytest.raises(ValueError, match=r"lie in \[0, 3\]"):
        ce.nll(f, torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match="shape"):
        ce.nll(torch.randn(3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="output's shape"):
        BernoulliBCE().nll(f, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="sigma"):
        Gaussian(sigma=0.0)
    with pytest.raises(ValueError, match="reduction"):
        CrossEntropy(reduction="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown likelihood"):
        get_likelihood("poisson")
