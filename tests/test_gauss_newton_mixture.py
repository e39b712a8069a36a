"""The two-component Bernoulli mixture head of thesis Eq. 4.28 (a non-exponential-family likelihood):
gradient and exact Hessian against torch.func, the PSD projection and its counter, the output Fisher
(= the expected Hessian over model labels), the sampler, KFLR = the exact GGN block, KFAC -> the Fisher
block (which differs from the GGN here), and one optimiser step against the dense projected GGN."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacrev

from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.likelihoods import BernoulliBCE, BernoulliMixture, CrossEntropy, Gaussian
from curvkit.models import mlp
from curvkit.optim import GaussNewton

pytestmark = pytest.mark.usefixtures("float64_default")


def _data(n: int, seed: int = 0, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g).to(torch.float64)


def _nll_one(h, y):
    """-log p(y | h) written directly from Eq. 4.28 (no logsumexp), for the references."""
    s = torch.sigmoid(h)
    b2 = s[1] ** y * (1 - s[1]) ** (1 - y)
    b3 = s[2] ** y * (1 - s[2]) ** (1 - y)
    return -torch.log(s[0] * b2 + (1 - s[0]) * b3)


def test_nll_gradient_and_exact_hessian_match_torch_func():
    lik = BernoulliMixture("sum")
    f, y = _data(30)
    assert torch.allclose(lik.nll_per_sample(f, y), torch.stack([_nll_one(a, b) for a, b in zip(f, y)]))
    G = torch.stack([grad(_nll_one)(a, b) for a, b in zip(f, y)])
    H = torch.stack([hessian(_nll_one)(a, b) for a, b in zip(f, y)])
    assert torch.allclose(lik.output_grad(f, y), G, atol=1e-12)
    assert torch.allclose(lik.output_hessian_exact(f, y), H, atol=1e-12)


def test_psd_projection_and_counter():
    lik = BernoulliMixture()
    f, y = _data(40, seed=1)
    Hx = lik.output_hessian_exact(f, y)
    lam, U = torch.linalg.eigh(Hx)
    negative = int((lam[:, 0] < -1e-12).sum())
    assert negative > 0  # the mixture NLL is not convex in h: the projection has work to do
    Hp = lik.output_hessian(f, y)
    assert lik.projections == negative and lik.evaluations == 40
    assert torch.allclose(Hp, (U * lam.clamp_min(0)[:, None, :]) @ U.mT, atol=1e-12)
    assert float(torch.linalg.eigvalsh(Hp).min()) > -1e-12
    # nearest PSD matrix in Frobenius norm: no PSD perturbation of it is closer to the exact Hessian
    P = torch.randn(40, 3, 3, generator=torch.Generator().manual_seed(2))
    cand = Hp + 0.01 * P @ P.mT
    assert bool(((cand - Hx).norm(dim=(1, 2)) >= (Hp - Hx).norm(dim=(1, 2)) - 1e-12).all())
    S = lik.output_hessian_sqrt(f, y)
    assert torch.allclose(S @ S.mT, Hp, atol=1e-12)
    assert lik.evaluations == 80
    with pytest.raises(ValueError, match="depends on the label"):
        lik.output_hessian(f)


def test_output_fisher_is_the_expected_hessian_and_differs_from_the_ggn():
    """F_L = sum_y p(y|h) g g^T = sum_y p(y|h) H_exact(h, y) (E[-hess log p] = E[grad grad^T]; Lemma 3.20
    with exact expectation), while the GGN's H_L at the data label is different (not an exponential family)."""
    lik = BernoulliMixture()
    f, y = _data(25, seed=3)
    S = lik.output_fisher_sqrt(f)
    F = S @ S.mT
    p1 = lik.prob_one(f)
    ref = torch.zeros(25, 3, 3)
    expected_h = torch.zeros(25, 3, 3)
    for lab, p in ((0.0, 1 - p1), (1.0, p1)):
        yy = torch.full((25,), lab)
        g = lik.output_grad(f, yy)
        ref += p[:, None, None] * g[:, :, None] * g[:, None, :]
        expected_h += p[:, None, None] * lik.output_hessian_exact(f, yy)
    assert torch.allclose(F, ref, atol=1e-12)
    assert torch.allclose(F, expected_h, atol=1e-12)
    assert float((lik.output_hessian(f, y) - F).norm()) > 0.1


def test_sampler_matches_the_model_probability():
    lik = BernoulliMixture()
    f = torch.tensor([[0.3, 2.0, -1.0], [-2.0, 0.0, 3.0]]).repeat(20000, 1)
    y = lik.sample(f, torch.Generator().manual_seed(4)).reshape(20000, 2)
    p = lik.prob_one(f[:2])
    se = (p * (1 - p) / 20000).sqrt()
    assert bool(((y.mean(0) - p).abs() < 4 * se).all())
    assert lik.accuracy(f[:2], (p > 0.5).to(torch.float64)) == 1.0


def _dense_blocks(net, X, y, H):
    """Dense diagonal GGN blocks sum_n J_n^T H_n J_n / N per layer (weight, bias) in flat order."""
    params = {n: p.detach() for n, p in net.named_parameters()}
    names = list(params)
    J = jacrev(lambda ps: functional_call(net, ps, (X,)))(params)  # name -> (B, 3, *shape)
    flat = torch.cat([J[n].reshape(X.shape[0], 3, -1) for n in names], -1)
    return torch.einsum("bci,bcd,bdj->ij", flat, H, flat) / X.shape[0]


def test_kflr_is_the_exact_ggn_block_and_kfac_tends_to_the_fisher_block():
    net = mlp([2, 3], "tanh", dtype=torch.float64, seed=0)  # one layer: the block is the whole matrix
    x = torch.randn(1, 2, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([1.0])
    lik = BernoulliMixture()
    f = net(x).detach()
    ggn = _dense_blocks(net, x, y, lik.output_hessian(f, y))
    S = lik.output_fisher_sqrt(f)
    fisher = _dense_blocks(net, x, y, S @ S.mT)
    kflr = KroneckerEstimator(net, lik, "kflr").update((x, y)).operator().to_dense()
    assert torch.allclose(kflr, ggn, atol=1e-12)
    kfra = KroneckerEstimator(net, lik, "kfra").update((x, y)).operator().to_dense()
    assert torch.allclose(kfra, ggn, atol=1e-12)  # batch size 1: KFRA is exact
    kfac = KroneckerEstimator(net, lik, "kfac", mc_samples=20000, seed=6).update((x, y)).operator().to_dense()
    rel = float((kfac - fisher).norm() / fisher.norm())
    assert rel < 0.03  # Monte Carlo: 20000 labels, relative error ~ 1/sqrt(20000) times O(1)
    assert float((ggn - fisher).norm() / fisher.norm()) > 0.2  # GGN != Fisher for this head


@pytest.mark.parametrize("lik", [BernoulliBCE(), CrossEntropy(), Gaussian(sigma=0.5), BernoulliMixture()])
def test_kfra_output_factor_is_the_batch_mean_hessian(lik):
    g = torch.Generator().manual_seed(7)
    f = torch.randn(700, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (700,), generator=g).to(torch.float64) if isinstance(lik, BernoulliMixture) else None
    if isinstance(lik, BernoulliMixture):
        ref = lik.output_hessian(f, y).mean(0)
    else:
        ref = lik.output_hessian(f).mean(0)
    # KFRA's G_L: the likelihood's sum of H_L over the batch, divided by B (closed form for softmax, diagonals for
    # BCE/Gaussian, dense blocks for the mixture)
    assert torch.allclose(lik.output_hessian_sum(f, y) / f.shape[0], ref, atol=1e-14)


def test_optimiser_step_uses_the_projected_ggn_at_the_labels():
    net = mlp([4, 5, 3], "tanh", dtype=torch.float64, seed=8)
    g_ = torch.Generator().manual_seed(8)
    X, y = torch.randn(12, 4, generator=g_), torch.randint(0, 2, (12,), generator=g_).to(torch.float64)
    lik = BernoulliMixture("mean")
    params = {n: p.detach() for n, p in net.named_parameters()}
    J = jacrev(lambda ps: functional_call(net, ps, (X,)))(params)
    Jf = torch.cat([J[n].reshape(12, 3, -1) for n in params], -1)
    Gd = torch.einsum("bci,bcd,bdj->ij", Jf, lik.output_hessian(net(X).detach(), y), Jf) / 12
    names = list(params)
    shapes = [p.shape for p in params.values()]

    def E(theta):
        ps, o = {}, 0
        for n, s in zip(names, shapes):
            k = math.prod(s)
            ps[n] = theta[o:o + k].reshape(s)
            o += k
        return lik(functional_call(net, ps, (X,)), y)

    th = torch.cat([p.reshape(-1) for p in params.values()])
    gvec = grad(E)(th)
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature="kflr", tau=0.1, zeta=0.1,
                      tau_every=0, zeta_every=0)
    opt.step(batch=(X, y))
    s = torch.cat([p.detach().reshape(-1) for p in net.parameters()]) - th
    alpha = opt.history[-1]["alpha"]
    d = s / alpha
    C = Gd + 0.1 * torch.eye(len(th))
    assert alpha == pytest.approx(-float(d @ gvec) / float(d @ C @ d), rel=1e-9)
    with pytest.raises(TypeError, match="depends on the labels"):
        opt.step(lambda: lik(net(X), y))
