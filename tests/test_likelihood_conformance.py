"""Conformance of every likelihood (issue 32: a new likelihood is one class plus this test): what the curvature
engine asks of it is consistent with its dense per-position output Hessian, padding included (float64; 1e-10).

Add a new likelihood to ``CASES`` with outputs and targets of its kind."""

from __future__ import annotations

import pytest
import torch

from curvkit.likelihoods import BernoulliBCE, BernoulliMixture, CrossEntropy, Gaussian, Likelihood

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


@pytest.mark.parametrize("name", ["ce", "ce-pad", "bce", "gaussian"])
def test_output_fisher_is_owned_by_the_likelihood_and_equals_its_definition(name):
    """Each built-in head's own closed-form output Fisher (columns, products, rank) equals F_L = E_y[g g^T] from
    its definition, enumerated over the labels, and its output Hessian (natural parameters, thesis Eqs.
    3.37-3.38)."""
    lik, f, _ = _case(name)
    C = f.shape[-1]
    S = lik.output_fisher_sqrt_columns(f, slice(None))
    F = S @ S.transpose(-1, -2)
    if isinstance(lik, CrossEntropy):  # sum over the C classes of p_c g g^T, g = p - e_c
        p = f.softmax(-1)
        g = p[..., None, :] - torch.eye(C, dtype=D64)
        want = torch.einsum("...c,...ci,...cj->...ij", p, g, g)
    elif isinstance(lik, BernoulliBCE):  # independent outputs: Var(y_i) on the diagonal
        s = torch.sigmoid(f)
        want = torch.diag_embed(s * (1 - s))
    else:
        want = torch.eye(C, dtype=D64).expand(*f.shape, C) / lik.sigma**2
    torch.testing.assert_close(F, want, **TOL)
    torch.testing.assert_close(F, lik._hessian(f), **TOL)
    V = torch.randn(2, *f.shape, generator=torch.Generator().manual_seed(3), dtype=D64)
    torch.testing.assert_close(lik.output_fisher_matvec(f, V), (want @ V[..., None])[..., 0], **TOL)
    assert lik.output_fisher_rank(f) == S.shape[-1] == C
    torch.testing.assert_close(lik.output_fisher_sqrt_columns(f, slice(1, 3)), S[..., 1:3], **TOL)


class Poisson(Likelihood):
    """A likelihood written in this test only (log link: -log p = exp(f) - y f + log y!): one class, nothing
    else in curvkit touched, and every route below takes it."""

    name = "Poisson"

    def _nll_terms(self, f, y):
        return (f.exp() - y * f + torch.lgamma(y + 1)).sum(-1)

    def _output_grad(self, f, y):
        return f.exp() - y

    def _hessian_diagonal(self, f):
        return f.exp()

    def _sample(self, f, generator):
        return torch.poisson(f.exp(), generator=generator)

    def output_fisher_sqrt(self, f):  # natural parameter: F_L = H_L = diag(exp f)
        return torch.diag_embed(f.exp().sqrt())

    def mean(self, f):  # the rate: what the Laplace MC predictive averages
        return f.exp()

    def predictive_nll_terms(self, prediction, y):
        return (prediction - y * prediction.log() + torch.lgamma(y + 1)).sum(-1)


def test_a_new_likelihood_is_one_class():
    """The Poisson head above through the exact GGN and type-2 Fisher operators (equal to dense J^T H J), KFLR
    (equal to the exact GGN block of one datum, Lemma 3.21), float64, 1e-10, and a Kronecker Laplace posterior
    (evidence, MC predictive; the probit link refused in words: it needs a logistic link)."""
    from torch import nn
    from torch.func import functional_call, jacrev

    from curvkit.curvature import FisherOperator, GGNOperator, KroneckerEstimator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(5, 3, dtype=D64)
    y = torch.poisson(torch.ones(5, 2, dtype=D64))
    lik = Poisson("sum")
    params = {n: p.detach() for n, p in model.named_parameters()}
    J = jacrev(lambda ps: functional_call(model, ps, (X,)))(params)
    Jf = torch.cat([J[n].reshape(5, 2, -1) for n in params], -1)  # (B, C, P)
    H = torch.diag_embed(model(X).detach().exp())
    G = torch.einsum("bcp,bcd,bdq->pq", Jf, H, Jf)
    torch.testing.assert_close(GGNOperator(model, lik, (X, y)).to_dense(), G, **TOL)
    torch.testing.assert_close(FisherOperator(model, lik, (X, y)).to_dense(), G, **TOL)
    one = KroneckerEstimator(model, lik, "kflr").update((X[:1], y[:1])).operator().to_dense()
    G1 = torch.einsum("cp,cd,dq->pq", Jf[0], H[0], Jf[0])
    last = slice(G.shape[0] - 10, G.shape[0])  # the output layer's weight and bias: an exact block
    torch.testing.assert_close(one[last, last], G1[last, last], **TOL)
    from curvkit.laplace import Laplace

    post = Laplace(model, lik, structure="kron", curvature="kflr", prior_precision=1.0).fit((X, y))
    assert torch.isfinite(post.log_marginal_likelihood())
    rate = post.predict(X, "mc", num_samples=8, generator=torch.Generator().manual_seed(0))
    assert rate.shape == (5, 2) and bool((rate > 0).all())
    with pytest.raises(NotImplementedError, match="probit approximation needs a softmax or sigmoid link"):
        post.predict(X, "glm", link="probit")
