"""Checks K1-K8, K10 of digest 004 for the dense and factorised Bayesian-filtering optimisers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from curvkit.optim.filters import BFAdam, BFAdamSS, BFNatGrad, BFRMSProp, BFRMSPropSS, DenseKalmanFilter
from curvkit.optim.filters.mapping import (
    adam_closed_forms,
    momentum_filter_fixed_point,
    momentum_stationary_prior,
    rmsprop_discrete_fixed_point,
    rmsprop_fixed_point,
)

DT = torch.float64


def _param(values) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.as_tensor(values, dtype=DT).clone())


def _set_grad(p: torch.Tensor, ascent: torch.Tensor) -> None:
    """Set p.grad so that the ascent gradient of the summed log-likelihood is ``ascent`` (reduction='sum')."""
    p.grad = -torch.as_tensor(ascent, dtype=DT).reshape(p.shape).clone()


# ----------------------------------------------------------------------------------------------- K1
def test_k1_single_bayes_step():
    # sigma_prior^2 = 0.5, Lambda = e^2 = 4, mu_prior = 1, mu_like = 3 -> g = 8, sigma_post^2 = 1/6
    p = _param([1.0])
    opt = DenseKalmanFilter([p], prior_cov=torch.tensor([[0.5]], dtype=DT))
    loss = 0.5 * 4.0 * (p - 3.0).pow(2).sum()
    loss.backward()
    opt.step(fisher=torch.tensor([[2.0]], dtype=DT))
    assert opt.covariance.item() == pytest.approx(1 / 6, abs=1e-12)
    assert opt.mean.item() == pytest.approx(1 + 8 / 6, abs=1e-12)
    # (4b): mu_post = Sigma_post (Sigma_prior^-1 mu_prior + Lambda mu_like)
    assert opt.mean.item() == pytest.approx((1 / 6) * (1 / 0.5 + 4 * 3), abs=1e-12)
    # factorised natural gradient takes the same step
    q = _param([1.0])
    nat = BFNatGrad([q], s0=0.5, curvature="given", reduction="sum")
    (0.5 * 4.0 * (q - 3.0).pow(2).sum()).backward()
    nat.step(fisher_diag=[torch.tensor([4.0], dtype=DT)])
    assert q.item() == pytest.approx(7 / 3, abs=1e-12)


# ----------------------------------------------------------------------------------------------- K2
def _textbook_scalar_kf(x, y, m0, P0, a, eta2, s2):
    m, P, out = m0, P0, []
    for xt, yt in zip(x, y):
        Pm = (1 - a) ** 2 * P + eta2           # predict covariance from Sigma_post(t-1)
        K = Pm * xt / (xt * xt * Pm + s2)
        m = m + K * (yt - xt * m)              # m here is already the prior mean mu_prior(t)
        P = (1 - K * xt) * Pm
        out.append((m, P))
        m = (1 - a) * m                        # prior mean of the next step
    return out


def test_k2_scalar_rmsprop_filter_is_exact_kalman():
    gen = torch.Generator().manual_seed(0)
    T, s2, eta, sigma2 = 60, 0.3, 0.2, 2.0
    a = eta**2 / (2 * sigma2)
    x = torch.randn(T, generator=gen, dtype=DT)
    y = 0.7 * x + math.sqrt(s2) * torch.randn(T, generator=gen, dtype=DT)
    p = _param([0.1])
    opt = BFRMSProp([p], lr=eta, sigma2=sigma2, s0=0.9, drift="paper", curvature="given", reduction="sum")
    ref = _textbook_scalar_kf(x.tolist(), y.tolist(), 0.1, 0.9, a, eta**2, s2)
    for t in range(T):
        p.grad = None
        (0.5 * (y[t] - p * x[t]).pow(2).sum() / s2).backward()
        opt.step(fisher_diag=[(x[t] ** 2 / s2).reshape(1)])
        st = opt.state[p]
        assert st["mu_post"].item() == pytest.approx(ref[t][0], abs=1e-12)
        assert st["s"].item() == pytest.approx(ref[t][1], abs=1e-12)

    # the empirical Fisher (e = g) is *not* the exact filter
    q = _param([0.1])
    emp = BFRMSProp([q], lr=eta, sigma2=sigma2, s0=0.9, drift="paper", curvature="empirical", reduction="sum")
    for t in range(T):
        q.grad = None
        (0.5 * (y[t] - q * x[t]).pow(2).sum() / s2).backward()
        emp.step()
    assert abs(emp.state[q]["mu_post"].item() - ref[-1][0]) > 1e-4


def test_k2_dense_filter_is_exact_kalman_with_drift():
    gen = torch.Generator().manual_seed(1)
    D, T, s2 = 3, 25, 0.5
    F = torch.eye(D, dtype=DT) * 0.97 + 0.01 * torch.randn(D, D, generator=gen, dtype=DT)
    Qh = 0.1 * torch.randn(D, D, generator=gen, dtype=DT)
    Q = Qh @ Qh.T + 1e-3 * torch.eye(D, dtype=DT)
    S0 = torch.eye(D, dtype=DT)
    w = torch.nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        w.weight.zero_()
    opt = DenseKalmanFilter(w.parameters(), prior_cov=S0, transition=F, process_noise=Q, reduction="sum")
    m, P = torch.zeros(D, dtype=DT), S0.clone()
    for _ in range(T):
        X = torch.randn(4, D, generator=gen, dtype=DT)
        y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=DT) + math.sqrt(s2) * torch.randn(4, generator=gen, dtype=DT)
        # textbook KF, batch of 4 observations
        P = F @ P @ F.T + Q
        K = P @ X.T @ torch.linalg.inv(X @ P @ X.T + s2 * torch.eye(4, dtype=DT))
        m = m + K @ (y - X @ m)
        P = (torch.eye(D, dtype=DT) - K @ X) @ P
        w.zero_grad()
        (0.5 * (y - w(X).squeeze(1)).pow(2).sum() / s2).backward()
        opt.step(fisher=X / math.sqrt(s2))
        torch.testing.assert_close(opt.mean, m, atol=1e-11, rtol=0)
        torch.testing.assert_close(opt.covariance, P, atol=1e-11, rtol=0)
        m = F @ m
        torch.testing.assert_close(w.weight.detach().reshape(-1), m, atol=1e-11, rtol=0)
    prec = opt.curvature().to_dense()
    torch.testing.assert_close(prec, torch.linalg.inv(P), atol=1e-8, rtol=1e-8)


# ----------------------------------------------------------------------------------------------- K3
def test_k3_natural_gradient_limit():
    p = _param([0.0])
    opt = BFNatGrad([p], s0=1.0, curvature="given", reduction="sum")
    for e in (1.0, 2.0, 3.0):
        p.grad = torch.zeros_like(p)
        opt.step(fisher_diag=[torch.tensor([e * e], dtype=DT)])
    assert opt.state[p]["s"].item() == pytest.approx(1 / 15, abs=1e-15)
    assert isinstance(opt.curvature().flat, torch.Tensor)
    assert opt.curvature().flat.item() == pytest.approx(15.0)


# ----------------------------------------------------------------------------------------------- K4
def test_k4_rmsprop_deterministic_fixed_point():
    cases = [(1e-3, 1.0, 9.995001250e-4), (1e-2, 1.0, 9.950125e-3), (1e-3, 100.0, 9.950125e-5)]
    ps = [_param([0.0]) for _ in cases]
    groups = [{"params": [p], "lr": eta, "s0": eta / math.sqrt(E) * (1 - eta * math.sqrt(E) / 2)}
              for p, (eta, E, _) in zip(ps, cases)]
    opt = BFRMSProp(groups, curvature="given", reduction="sum")
    fis = [torch.tensor([E], dtype=DT) for _, E, _ in cases]
    for _ in range(8000):
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt.step(fisher_diag=fis)
    for p, (eta, E, expect) in zip(ps, cases):
        s = opt.state[p]["s"].item()
        assert s == pytest.approx(rmsprop_discrete_fixed_point(eta, E), rel=1e-8)
        assert s == pytest.approx(expect, rel=1e-6)
        rel = s / rmsprop_fixed_point(eta, E) - 1
        assert rel == pytest.approx(-eta * math.sqrt(E) / 2, rel=0.02)  # RMSProp form is first-order only


def test_k4_rmsprop_stochastic_steady_state():
    # e ~ N(0, E), vectorised over 4000 independent weights; digest: mean(s)/(eta/sqrt E) = 1.0024, <1% off 1
    eta, E, n = 1e-2, 1.0, 4000
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(n, dtype=DT))
    opt = BFRMSProp([p], lr=eta, s0=eta, curvature="given", reduction="sum")
    acc, count = torch.zeros(n, dtype=DT), 0
    for t in range(1500):
        p.grad = torch.zeros_like(p)
        e = torch.randn(n, generator=gen, dtype=DT) * math.sqrt(E)
        opt.step(fisher_diag=[e * e])
        if t >= 500:
            acc += opt.state[p]["s"]
            count += 1
    ratio = (acc / count).mean().item() / (eta / math.sqrt(E))
    assert abs(ratio - 1.0024) < 0.005 and abs(ratio - 1) < 0.01


# ----------------------------------------------------------------------------------------------- K5
@pytest.mark.parametrize(("E", "exact"), [(1.0, 9.94520e-4), (1e-6, 9.901976e-2), (1e4, 9.51206e-6)])
def test_k5_finite_sigma2_fixed_point(E, exact):
    eta, sigma2 = 1e-3, 0.1
    p = _param([0.0])
    opt = BFRMSProp([p], lr=eta, sigma2=sigma2, s0=rmsprop_fixed_point(eta, E, sigma2), drift="paper",
                    curvature="given", reduction="sum")
    for _ in range(4000):
        p.grad = torch.zeros_like(p)
        opt.step(fisher_diag=[torch.tensor([E], dtype=DT)])
    s = opt.state[p]["s"].item()
    assert s == pytest.approx(exact, rel=2e-5)
    rel = s / rmsprop_fixed_point(eta, E, sigma2) - 1
    assert abs(rel) <= eta * math.sqrt(E) + eta**2 / sigma2


# ----------------------------------------------------------------------------------------------- K6
def test_k6_adam_ss_is_lagged_adam():
    c, eta, eta_p, T = 2.0, 1e-3, 0.1, 400
    gen = torch.Generator().manual_seed(3)
    signs = torch.randint(0, 2, (T,), generator=gen).to(DT) * 2 - 1
    p = _param([0.0])
    opt = BFAdamSS([p], lr=eta, eta_p=eta_p, eps=0.0, curvature="empirical", reduction="sum")
    q = _param([0.0])
    ref = torch.optim.Adam([q], lr=eta, betas=(1 - eta_p, 0.999), eps=0.0)
    m, beta1 = 0.0, 1 - eta_p
    prev = p.item()
    for t in range(T):
        g = c * signs[t].item()
        _set_grad(p, torch.tensor([g]))
        opt.step()
        q.grad = torch.tensor([-g], dtype=DT)     # Adam minimises; ascent g
        before = q.item()
        ref.step()
        m = beta1 * m + (1 - beta1) * g
        # displacement of the lookahead parameters = eta * mu_p(t) = Adam(no bias correction) step at t
        disp = p.item() - prev
        prev = p.item()
        assert disp == pytest.approx(eta * m / c, abs=1e-15)
        assert disp / (1 - beta1 ** (t + 1)) == pytest.approx(q.item() - before, rel=1e-10)


def test_k6_rmsprop_ss_equals_torch_rmsprop():
    torch.manual_seed(0)
    a = torch.nn.Linear(5, 3)
    b = torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    opt = BFRMSPropSS(a.parameters(), lr=1e-2, beta2=0.9, eps=0.0, bias_correction=False, reduction="mean",
                      batch_size=8)
    ref = torch.optim.RMSprop(b.parameters(), lr=1e-2, alpha=0.9, eps=0.0)
    for _ in range(20):
        X, y = torch.randn(8, 5), torch.randn(8, 3)
        for net, o in ((a, opt), (b, ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(net(X), y).backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- K7
def test_k7_momentum_stationary_prior_and_init():
    for eta, eta_w, eta_p, s2, want in [(1e-3, 0, 0.1, 1, (0.9999955, 4.736821e-4, 0.05263158)),
                                         (1e-3, 1e-3, 0.1, 1, (0.9999958, 4.736799e-4, 0.05263158)),
                                         (1e-2, 0, 0.1, 0.5, (0.499552, 4.733e-3, 0.052632))]:
        Psi = momentum_stationary_prior(eta, eta_p, eta_w, s2)
        np.testing.assert_allclose([Psi[0, 0], Psi[0, 1], Psi[1, 1]], want, rtol=1e-3)
        assert Psi[1, 1] == pytest.approx(eta_p / (2 - eta_p), rel=1e-12)
        p = _param([0.0])
        opt = BFAdam([p], lr=eta, eta_p=eta_p, eta_w=eta_w, sigma2=s2)
        opt._init_state(p, opt.state[p], opt.param_groups[0])
        st = opt.state[p]
        np.testing.assert_allclose([st["S_ww"].item(), st["S_wp"].item(), st["S_pp"].item()],
                                   [Psi[0, 0], Psi[0, 1], Psi[1, 1]], rtol=1e-10)


# ----------------------------------------------------------------------------------------------- K8
def test_k8_exact_momentum_filter_matches_dare_and_not_closed_forms():
    eta, eta_p = 1e-3, 0.1
    Es = [1e6, 1e7]
    p = torch.nn.Parameter(torch.zeros(len(Es), dtype=DT))
    opt = BFAdam([p], lr=eta, eta_p=eta_p, s0=1e-6, curvature="given", reduction="sum")
    for _ in range(3000):
        p.grad = torch.zeros_like(p)
        opt.step(fisher_diag=[torch.tensor(Es, dtype=DT)])
    st = opt.state[p]
    for i, E in enumerate(Es):
        S = momentum_filter_fixed_point(eta, eta_p, E)
        np.testing.assert_allclose([st["S_ww"][i].item(), st["S_wp"][i].item(), st["S_pp"][i].item()],
                                   [S[0, 0], S[0, 1], S[1, 1]], rtol=1e-8)
        ww, wp = adam_closed_forms(eta, eta_p, E)
        ratio = st["S_wp"][i].item() / wp
        assert 0.5 < ratio < 0.6   # digest: 0.52-0.53, i.e. the closed forms are only within a factor 2
        assert 0.5 < st["S_ww"][i].item() / ww < 1.0


@pytest.mark.parametrize(("G", "expect"), [(1e3, 8.3212e-4), (3e3, 7.0235e-4)])
def test_k8_exact_filter_effective_lr_is_not_eta(G, expect):
    p = _param([0.0])
    opt = BFAdam([p], lr=1e-3, eta_p=0.1, s0=1e-6, curvature="empirical", reduction="sum")
    prev = 0.0
    for _ in range(3000):
        _set_grad(p, torch.tensor([G]))
        opt.step()
        disp, prev = p.item() - prev, p.item()
    assert disp == pytest.approx(expect, rel=1e-4)
    st = opt.state[p]
    assert disp == pytest.approx(((1e-3 * st["S_wp"] / 0.1 + st["S_ww"]) * G).item(), rel=1e-9)


# ----------------------------------------------------------------------------------------------- K10
def test_k10_invariants_rmsprop_filter():
    eta, sigma2 = 0.05, 0.2
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.ones(50, dtype=DT))
    opt = BFRMSProp([p], lr=eta, sigma2=sigma2, drift="paper", curvature="empirical", reduction="sum")
    a = eta**2 / (2 * sigma2)
    for _ in range(50):
        _set_grad(p, torch.randn(50, generator=gen, dtype=DT) * 3)
        s_before = opt.state[p]["s"].clone() if opt.state[p] else torch.full_like(p, sigma2)
        s_prior = (1 - a) ** 2 * s_before + eta**2
        opt.step()
        s = opt.state[p]["s"]
        assert bool((s <= s_prior + 1e-15).all())                     # posterior shrinks
        assert bool((s <= sigma2 / (1 - a / 2) + 1e-12).all())        # SGD cap
    # g = 0: the mean decays by exactly (1 - a) per step, whatever s is (decoupled weight decay)
    mu = opt.state[p]["mu_post"].clone()
    p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(opt.state[p]["mu_post"], mu * (1 - a) ** 1, atol=1e-15, rtol=0)
    # sigma2 = inf, e = 0: s grows by exactly eta^2
    q = _param([0.0])
    o2 = BFRMSProp([q], lr=eta, s0=0.01, curvature="given", reduction="sum")
    for k in range(1, 4):
        q.grad = torch.zeros_like(q)
        o2.step(fisher_diag=[torch.zeros(1, dtype=DT)])
        assert o2.state[q]["s"].item() == pytest.approx(0.01 + k * eta**2, abs=1e-15)


def test_k10_gradient_is_taken_at_the_prior_mean():
    eta, eta_p, sigma2 = 0.1, 0.3, 0.5
    p = _param([0.4, -0.2])
    opt = BFAdam([p], lr=eta, eta_p=eta_p, sigma2=sigma2, curvature="empirical", reduction="sum")
    a = eta**2 / (2 * sigma2)
    seen = []

    def closure():
        seen.append(p.detach().clone())
        p.grad = None
        loss = (p - 1.0).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
        st = opt.state[p]
        expected_next = (1 - a) * st["mu_post"] + eta * st["mu_p"]
        torch.testing.assert_close(p.detach(), expected_next, atol=1e-15, rtol=0)
    assert len(seen) == 5
    with opt.posterior_mean():
        torch.testing.assert_close(p.detach(), opt.state[p]["mu_post"])
    torch.testing.assert_close(p.detach(), expected_next)


@pytest.mark.parametrize("sigma2_kind", ["sgd", "adam", "mid"])
def test_k10_batch_size_duplication_invariance(sigma2_kind):
    """Same example repeated B times, mean loss, batch_size=B, sigma^2 = lr_sgd/B: same step for B=1, 8."""
    lr_sgd, eta = 0.1, {"sgd": 1e4, "adam": 1e-6, "mid": 1e-2}[sigma2_kind]
    x = torch.tensor([[0.3, -1.2, 2.0]], dtype=DT)
    steps = []
    for B in (1, 8):
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 1).double()
        opt = BFRMSPropSS(net.parameters(), lr=eta, sigma2=lr_sgd / B, reduction="mean", batch_size=B,
                          drift="paper", eps=0.0)
        before = [q.detach().clone() for q in net.parameters()]
        X = x.repeat(B, 1)
        torch.nn.functional.mse_loss(net(X), torch.ones(B, 1, dtype=DT)).backward()
        g1 = [q.grad.clone() for q in net.parameters()]
        opt.step()
        with opt.posterior_mean():
            steps.append([q.detach() - b for q, b in zip(net.parameters(), before)])
    for s1, s8 in zip(*steps):
        torch.testing.assert_close(s1, s8, rtol=1e-10, atol=1e-14)
    if sigma2_kind == "sgd":
        for s, g in zip(steps[0], g1):
            torch.testing.assert_close(s, -lr_sgd * g, rtol=1e-4, atol=1e-12)
    if sigma2_kind == "adam":
        for s, g in zip(steps[0], g1):
            torch.testing.assert_close(s, -eta * g.sign(), rtol=1e-4, atol=1e-14)


def test_k6_combined_adam_ss_step_matches_the_formulas():
    """O6 with combine=True (Sec. 2.2.7): Sigma_wp = eta_p/sqrt(v_hat), Sigma_ww = sqrt((eta_w^2 + 2 eta
    Sigma_wp)/v_hat), mu_p = Sigma_wp g, mu_w = mu_prior + Sigma_ww g, next prior (1-a) mu_w + eta mu_p."""
    eta, eta_p, eta_w, beta2, sigma2 = 0.05, 0.2, 0.01, 0.9, 0.4
    p0 = torch.tensor([0.3, -1.0, 2.0], dtype=DT)
    g = torch.tensor([1.5, -0.2, 4.0], dtype=DT)
    p = _param(p0)
    opt = BFAdamSS([p], lr=eta, eta_p=eta_p, eta_w=eta_w, beta2=beta2, eps=0.0, bias_correction=False,
                   combine=True, sigma2=sigma2, reduction="sum")
    _set_grad(p, g)
    opt.step()
    v = (1 - beta2) * g**2
    Swp = eta_p / v.sqrt()
    Sww = ((eta_w**2 + 2 * eta * Swp) / v).sqrt()
    a = (eta**2 + eta_w**2) / (2 * sigma2)
    torch.testing.assert_close(opt.state[p]["mu_post"], p0 + Sww * g, atol=1e-14, rtol=0)
    torch.testing.assert_close(p.detach(), (1 - a) * (p0 + Sww * g) + eta * Swp * g, atol=1e-14, rtol=0)
    torch.testing.assert_close(opt.curvature().flat, 1 / Sww, atol=0, rtol=1e-12)
    torch.testing.assert_close(opt.effective_lr()["group0.param0"], Sww + Swp * eta / eta_p, atol=0, rtol=1e-12)
