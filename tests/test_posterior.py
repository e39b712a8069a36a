"""Mean-field Gaussian posterior utilities: functional sampling, vectorised MC gradients (paper Eq. 1)
against a loop over samples with the same noise, and the MC / MAP predictions."""

from __future__ import annotations

import pytest
import torch

from curvkit.likelihoods import CrossEntropy
from curvkit.posterior import mc_gradients, mc_gradients_loop, predict_map, predict_mc, sample_eps

DT = torch.float64




def _sum_ce(f, y):
    return CrossEntropy("sum").nll_per_sample(f, y).sum()


def _posterior(model, sigma=0.1):
    mu = {n: p.detach() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(3)
    sig = {n: sigma * (0.5 + torch.rand(p.shape, generator=g, dtype=DT)) for n, p in mu.items()}
    return mu, sig


@pytest.mark.parametrize("kind,xshape", [("mlp", (6, 4)), ("cnn", (6, 1, 8, 8))])
def test_vectorised_mc_gradients_equal_loop_for_same_eps(kind, xshape, make_mlp, make_cnn):
    model = make_mlp() if kind == "mlp" else make_cnn()
    X = torch.randn(*xshape, dtype=DT, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    mu, sig = _posterior(model)
    eps = sample_eps(mu, 5, torch.Generator().manual_seed(7))
    a = mc_gradients(model, _sum_ce, X, y, mu, sig, eps=eps)
    b = mc_gradients_loop(model, _sum_ce, X, y, mu, sig, eps=eps)
    c = mc_gradients(model, _sum_ce, X, y, mu, sig, eps=eps, chunk_size=2)
    for n in mu:
        torch.testing.assert_close(a.g_mu[n], b.g_mu[n], rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(a.g_sigma[n], b.g_sigma[n], rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(c.g_sigma[n], b.g_sigma[n], rtol=1e-12, atol=1e-13)
        assert a.g_sigma[n].abs().sum() > 0
    torch.testing.assert_close(a.losses, b.losses, rtol=1e-12, atol=1e-13)
    assert a.losses.shape == (5,)


def test_same_generator_state_gives_same_noise(make_mlp):
    model = make_mlp()
    X, y = torch.randn(4, 4, dtype=DT), torch.tensor([0, 1, 2, 0])
    mu, sig = _posterior(model)
    a = mc_gradients(model, _sum_ce, X, y, mu, sig, 3, torch.Generator().manual_seed(5))
    b = mc_gradients_loop(model, _sum_ce, X, y, mu, sig, 3, torch.Generator().manual_seed(5))
    for n in mu:
        torch.testing.assert_close(a.eps[n], b.eps[n], rtol=0, atol=0)
        torch.testing.assert_close(a.g_mu[n], b.g_mu[n], rtol=1e-12, atol=1e-13)


def test_eps_shared_across_minibatch_and_gradient_formula(make_mlp):
    """One eps per weight per sample shared by the batch: the batch-sum gradient at w_k equals the sum of
    per-example gradients at the same w_k; g_mu / g_sigma are the plain means of g_k and g_k * eps_k."""
    model = make_mlp()
    X, y = torch.randn(3, 4, dtype=DT), torch.tensor([2, 0, 1])
    mu, sig = _posterior(model)
    eps = sample_eps(mu, 2, torch.Generator().manual_seed(0))
    full = mc_gradients(model, _sum_ce, X, y, mu, sig, eps=eps)
    parts = [mc_gradients(model, _sum_ce, X[i:i + 1], y[i:i + 1], mu, sig, eps=eps) for i in range(3)]
    for n in mu:
        torch.testing.assert_close(full.g_sigma[n], sum(p.g_sigma[n] for p in parts), rtol=1e-12, atol=1e-13)


def test_deterministic_parameters_stay_fixed(make_mlp):
    model = make_mlp()
    X, y = torch.randn(4, 4, dtype=DT), torch.tensor([0, 1, 2, 0])
    mu = {"2.weight": model[2].weight.detach()}
    sig = {"2.weight": torch.full_like(mu["2.weight"], 0.1)}
    eps = sample_eps(mu, 4, torch.Generator().manual_seed(0))
    a = mc_gradients(model, _sum_ce, X, y, mu, sig, eps=eps)
    b = mc_gradients_loop(model, _sum_ce, X, y, mu, sig, eps=eps)
    assert set(a.g_mu) == {"2.weight"}
    torch.testing.assert_close(a.g_mu["2.weight"], b.g_mu["2.weight"], rtol=1e-12, atol=1e-13)


def test_mismatched_posterior_raises(make_mlp):
    model = make_mlp()
    mu, sig = _posterior(model)
    sig["0.weight"] = sig["0.weight"][:1]
    with pytest.raises(ValueError, match="shape"):
        mc_gradients(model, _sum_ce, torch.randn(2, 4, dtype=DT), torch.tensor([0, 1]), mu, sig, 2)
    with pytest.raises(ValueError, match="mc_samples"):
        sample_eps(mu, 0)


def test_predict_mc_is_average_of_sampled_softmax_and_map_at_zero_sigma(make_mlp):
    model = make_mlp()
    X = torch.randn(7, 4, dtype=DT)
    mu, sig = _posterior(model, 0.3)
    eps = sample_eps(mu, 4, torch.Generator().manual_seed(2))
    p = predict_mc(model, X, sig, eps=eps, batch_size=3)
    ref = torch.zeros(7, 3, dtype=DT)
    for k in range(4):
        w = {n: mu[n] + sig[n] * eps[n][k] for n in mu}
        ref += torch.func.functional_call(model, w, (X,)).softmax(-1) / 4
    torch.testing.assert_close(p, ref, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(p.sum(-1), torch.ones(7, dtype=DT))
    zero = {n: torch.zeros_like(s) for n, s in sig.items()}
    torch.testing.assert_close(predict_mc(model, X, zero, 3), predict_map(model, X, batch_size=2))
    torch.testing.assert_close(predict_map(model, X), model(X).softmax(-1))
