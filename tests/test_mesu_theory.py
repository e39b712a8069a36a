"""The MESU paper's theory (digest 000 section 6, checks T1-T8) on the library's optimisers, float64.

Deterministic recursions feed the optimisers the exact expected gradients of a diagonal quadratic
L(w) = 1/2 sum_i h_i (w_i - w*_i)^2, for which E[g_mu] = h (mu - w*) and E[g_sigma] = h sigma (Stein),
through ``step(grads=...)``; the stochastic checks run the full vectorised MC step.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, vmap

from curvkit.likelihoods import CrossEntropy
from curvkit.optim import BGD, MESU, MESUNoReg
from curvkit.posterior import MCGradients, likelihood_loss, mc_gradients, sample_eps

DT = torch.float64


H = torch.logspace(-3, 1.7, 24, dtype=DT)  # curvatures in [1e-3, 50], all below 1/sigma_0^2 = 100


class Vector(nn.Module):
    """A module whose output is its own parameter vector (so a quadratic loss is a 'network')."""

    def __init__(self, init: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(init.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w


def expected_step(opt, h, w_star=None):
    """One optimiser step with the exact expected gradients of the quadratic."""
    p = opt.param_groups[0]["params"][0]
    s = opt.state[p]["sigma"].clone()
    g_mu = h * (p.detach() - w_star) if w_star is not None else torch.zeros_like(s)
    opt.step(grads=MCGradients({"w": g_mu}, {"w": h * s}, torch.zeros(1, dtype=DT), {}))


def run(opt, h, n):
    for _ in range(n):
        expected_step(opt, h)
    return opt.curvature().flat


# ---------------------------------------------------------------- T1: Lemma 1 (Stein) ----------
def test_T1a_lemma1_closed_form_quartic():
    """L = w^4: C = mu^4 + 6 mu^2 s^2 + 3 s^4 and d2C/dmu2 = (1/s) dC/ds (to 1e-10)."""
    mu = torch.tensor(0.7, dtype=DT, requires_grad=True)
    s = torch.tensor(0.3, dtype=DT, requires_grad=True)
    C = mu**4 + 6 * mu**2 * s**2 + 3 * s**4
    dmu, ds = torch.autograd.grad(C, (mu, s), create_graph=True)
    (d2mu,) = torch.autograd.grad(dmu, mu)
    assert abs(float((d2mu - ds / s).detach())) < 1e-10
    assert abs(float(d2mu) - (12 * 0.49 + 12 * 0.09)) < 1e-10


@pytest.mark.parametrize(
    "loss,exact",
    [
        (lambda w: (w**4).sum(), lambda m, s: 12 * m**2 + 12 * s**2),
        (lambda w: torch.exp(w).sum(), lambda m, s: math.exp(m + s**2 / 2)),
        (lambda w: nn.functional.softplus(2.0 * w).sum(), None),
    ],
)
def test_T1a_lemma1_monte_carlo_scalar(loss, exact):
    """Vectorised MC estimate g_sigma / sigma (1e6 antithetic samples) = d2C/dmu2 within 1e-2 relative."""
    m0, s0 = 0.7, 0.3
    model = Vector(torch.tensor([m0], dtype=DT))
    mu = {"w": model.w.detach()}
    sig = {"w": torch.tensor([s0], dtype=DT)}
    eps = sample_eps(mu, 500_000, torch.Generator().manual_seed(0))
    eps = {"w": torch.cat([eps["w"], -eps["w"]])}
    g = mc_gradients(model, lambda f, y: loss(f), torch.zeros(1, dtype=DT), torch.zeros(1), mu, sig, eps=eps)
    stein = float(g.g_sigma["w"] / s0)
    if exact is None:  # softplus(2w): E[L''] by Gauss-Hermite quadrature
        xs, ws = np.polynomial.hermite_e.hermegauss(80)
        x, wts = torch.from_numpy(xs), torch.from_numpy(ws) / math.sqrt(2 * math.pi)
        sg = torch.sigmoid(2 * (m0 + s0 * x))
        ref = float((4 * sg * (1 - sg) * wts).sum())
    else:
        ref = float(exact(m0, s0))
    assert abs(stein / ref - 1) < 1e-2


def test_T1b_T2_lemma1_and_eq4_on_a_tanh_network():
    """Stein estimate g_sigma/sigma (vectorised MC, 10 chunks of 1000 antithetic samples) vs the exact
    E_eps[diag d2L/dw2] (double backward at 300 weight samples) on a 3-4-2 tanh MLP, sum loss over 8 points,
    sigma = 0.1: Pearson > 0.99 and every layer's mean difference within 4 combined standard errors.
    T2 (Eqs. 4-5): E[eps^2 L''] (= H_D(sigma)) vs E[L''] (= H_D(mu)), Pearson > 0.99."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    X, y = torch.randn(8, 3, dtype=DT), torch.randint(0, 2, (8,))
    loss = likelihood_loss(CrossEntropy("sum"))
    s0 = 0.1
    mu = {n: p.detach() for n, p in model.named_parameters()}
    sig = {n: torch.full_like(p, s0) for n, p in mu.items()}
    names = list(mu)
    numel = [mu[n].numel() for n in names]
    flat_mu = torch.cat([mu[n].reshape(-1) for n in names])
    gen = torch.Generator().manual_seed(1)

    def L(theta):
        ps = {n: t.reshape(mu[n].shape) for n, t in zip(names, theta.split(numel))}
        return loss(functional_call(model, ps, (X,)), y)

    chunks = []
    for _ in range(10):
        eps = sample_eps(mu, 500, gen)
        eps = {n: torch.cat([e, -e]) for n, e in eps.items()}
        g = mc_gradients(model, loss, X, y, mu, sig, eps=eps)
        chunks.append(torch.cat([(g.g_sigma[n] / s0).reshape(-1) for n in names]))
    st = torch.stack(chunks)  # (10, d) chunk means of the Stein estimator
    E = torch.randn(300, flat_mu.numel(), dtype=DT, generator=gen)
    Hd = vmap(lambda w: torch.diagonal(hessian(L)(w)))(flat_mu + s0 * E)  # (300, d) exact per sample
    stein, exact = st.mean(0), Hd.mean(0)
    assert torch.corrcoef(torch.stack([stein, exact]))[0, 1] > 0.99
    assert torch.corrcoef(torch.stack([(Hd * E**2).mean(0), exact]))[0, 1] > 0.99
    offs = [0, *torch.tensor(numel).cumsum(0).tolist()]
    for a, b in itertools.pairwise(offs):
        st_l, ex_l = st[:, a:b].mean(1), Hd[:, a:b].mean(1)
        se = math.sqrt(float(st_l.var()) / len(st_l) + float(ex_l.var()) / len(ex_l))
        assert abs(float(st_l.mean() - ex_l.mean())) < 4 * se, (a, b)


def test_T2_quadratic_exact():
    """For a quadratic, H_D(sigma) = E[eps^2] h = h = H_D(mu) exactly (Eqs. 4-5): check via autograd of
    the closed-form C = 1/2 h ((mu - w*)^2 + sigma^2)."""
    mu = torch.tensor([0.3, -1.0], dtype=DT, requires_grad=True)
    s = torch.tensor([0.2, 0.05], dtype=DT, requires_grad=True)
    h = torch.tensor([2.0, 7.0], dtype=DT)
    C_fn = lambda m, sg: 0.5 * (h * ((m - 1.0) ** 2 + sg**2)).sum()  # noqa: E731
    Hm = torch.autograd.functional.hessian(lambda m: C_fn(m, s), mu).diagonal()
    Hs = torch.autograd.functional.hessian(lambda sg: C_fn(mu, sg), s).diagonal()
    torch.testing.assert_close(Hm, h)
    torch.testing.assert_close(Hs, h)


# ---------------------------------------------------------------- T3: Theorem 1 ----------------
def test_T3_exact_fixed_point_and_relaxation_time():
    sp, sr = 0.1, 10.0
    star = sp / torch.sqrt(sr**2 * H + 1)  # sigma*^2 = sp^2 / (sr^2 H + 1), exact
    model = Vector(torch.zeros_like(H))
    opt = MESU(model.parameters(), model=model, sigma_prior=sp, sigma_res=sr)
    p = model.w
    opt.state[p]["sigma"].copy_(star)
    expected_step(opt, H)
    torch.testing.assert_close(opt.state[p]["sigma"], star, rtol=1e-13, atol=0)
    torch.testing.assert_close(opt.curvature().flat, H, rtol=1e-9, atol=1e-12)  # Eq. 7 exact there
    # local rate g'(sigma*) = 1 - 2 sp^2/sr^2, the same for every H: tau = sr^2 / (2 sp^2) = 5000
    delta = 1e-7
    opt.state[p]["sigma"].copy_(star * (1 + delta))
    expected_step(opt, H)
    rate = (opt.state[p]["sigma"] / star - 1) / delta
    torch.testing.assert_close(rate, torch.full_like(H, 1 - 2 * sp**2 / sr**2), rtol=0, atol=1e-6)
    assert opt.relaxation_time() == pytest.approx(5000.0)


def test_T3_transient_matches_leaky_integrator_and_digest_numbers():
    """From sigma_0 = sigma_p: H_MESU(n)/H ~ 1 - exp(-2 n sp^2/sr^2) (within 1% for n >= tau), and the
    digest's measured 0.181 at n = 1e3 for (0.1, 10); debias=True recovers H."""
    sp, sr = 0.1, 10.0
    net = Vector(torch.zeros_like(H))
    opt = MESU(net.parameters(), model=net, sigma_prior=sp, sigma_res=sr)
    est = run(opt, H, 1000) / H
    assert torch.allclose(est, torch.full_like(H, 0.181), atol=1.5e-3)
    for n_more in (1500, 2500):
        est = run(opt, H, n_more) / H
        n = opt.num_steps
        torch.testing.assert_close(est, torch.full_like(H, 1 - math.exp(-2 * n * sp**2 / sr**2)), rtol=1e-2, atol=0)
    torch.testing.assert_close(opt.curvature(debias=True).flat, H, rtol=1e-2, atol=0)


def test_T3_collapse_outside_theorem_is_flagged_and_floor_prevents_it():
    """sigma_0 = 1/sqrt(H) (sigma_0 = 0.1, H = 100) collapses sigma to <= 0 in one step; the always-on
    diagnostics count it; the optional floor keeps sigma positive."""
    h = torch.tensor([100.0, 1.0], dtype=DT)
    net = Vector(torch.zeros(2, dtype=DT))
    opt = MESU(net.parameters(), model=net, sigma_prior=0.1, sigma_res=10.0)
    expected_step(opt, h)
    d = opt.diagnostics
    assert d["steps_large_sigma_grad"] == 1 and d["weights_large_sigma_grad"] == 1
    assert d["steps_nonpositive_sigma"] == 1 and d["weights_nonpositive_sigma"] == 1
    assert d["sigma_sign_flips"] == 1
    assert float(opt.state[opt.param_groups[0]["params"][0]]["sigma"][0]) <= 1e-15
    net = Vector(torch.zeros(2, dtype=DT))
    safe = MESU(net.parameters(), model=net, sigma_prior=0.1, sigma_res=10.0, sigma_min=1e-3)
    expected_step(safe, h)
    assert float(safe.state[safe.param_groups[0]["params"][0]]["sigma"].min()) == pytest.approx(1e-3)
    assert safe.diagnostics["weights_nonpositive_sigma"] == 1  # counted before the safeguard


# ---------------------------------------------------------------- T4/T5: stochastic, Newton -----
def test_T4_T5_stochastic_mesu_converges_to_theorem1_and_takes_newton_steps():
    """Full vectorised MC step (K = 10) on a noisy diagonal quadratic, sp = 0.3, sr = 3 (tau = 50 steps),
    h in [1e-3, 8], 12 tau steps. Median |sigma^2/sigma*^2 - 1| < 5% over the last 100 steps' average,
    mu within a few sigma* of w*, and the step is -sigma^2 g_mu (Newton lr sp^2/sr^2, damping 1/sr^2)."""
    sp, sr = 0.3, 3.0
    h = torch.logspace(-3, math.log10(8.0), 16, dtype=DT)
    w_star = torch.linspace(-1, 1, 16, dtype=DT)
    noise = torch.Generator().manual_seed(4)

    def loss(f, xi):
        return 0.5 * (h * (f - w_star) ** 2).sum() + (xi * f).sum()

    model = Vector(w_star + 0.3)
    opt = MESU(model.parameters(), model=model, sigma_prior=sp, sigma_res=sr, mc_samples=10, loss_fn=loss, seed=1)
    x = torch.zeros(1, dtype=DT)
    acc = torch.zeros_like(h)
    for i in range(600):
        opt.step(batch=(x, 0.05 * torch.randn(16, dtype=DT, generator=noise)))
        if i >= 500:
            acc += opt.state[model.w]["sigma"] ** 2 / 100
    star2 = sp**2 / (sr**2 * h + 1)
    assert float((acc / star2 - 1).abs().median()) < 0.05
    assert bool(((model.w.detach() - w_star).abs() < 4 * star2.sqrt() + 0.02).all())
    # T5: the applied mu step equals -sigma^2 * g_mu with sigma^2 ~ sp^2/(sr^2 h + 1)
    before, s = model.w.detach().clone(), opt.state[model.w]["sigma"].clone()
    g = opt.mc_gradients(x, torch.zeros(16, dtype=DT))
    opt.step(grads=g)
    torch.testing.assert_close(model.w.detach() - before, -(s**2) * g.g_mu["w"], rtol=1e-12, atol=1e-15)


def test_T5_newton_contraction_factor():
    """At sigma = sigma*, expected gradients: mu - w* contracts by 1 - sp^2 h/(sr^2 h + 1) per step."""
    sp, sr = 0.1, 10.0
    w_star = torch.ones_like(H)
    model = Vector(w_star + 0.5)
    opt = MESU(model.parameters(), model=model, sigma_prior=sp, sigma_res=sr)
    opt.state[model.w]["sigma"].copy_(sp / torch.sqrt(sr**2 * H + 1))
    e0 = (model.w.detach() - w_star).clone()
    expected_step(opt, H, w_star)
    factor = (model.w.detach() - w_star) / e0
    torch.testing.assert_close(factor, 1 - sp**2 * H / (sr**2 * H + 1), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- T6: Theorem 2 -----------------
def test_T6_theorem2_asymptotics_and_floor():
    """MESU w/o reg: sigma <- sigma - sigma^3 H. 2 n sigma_n^2 H = 0.950 at n = 1e3 (H = 1, sigma_0 = 0.1;
    digest), ~ 1/(1 + 1/(2 n H sigma_0^2)) for every H; the Eq. 9 estimate 1/(2 n sigma^2) carries the floor
    1/(2 n sigma_0^2) (5e-4 at n = 1e5); debias=True removes it."""
    h = torch.tensor([1.0, 0.1, 0.01, 1e-3, 1e-4], dtype=DT)
    net = Vector(torch.zeros_like(h))
    opt = MESUNoReg(net.parameters(), model=net, sigma_init=0.1)
    p = opt.param_groups[0]["params"][0]
    run(opt, h, 1000)
    assert float(2 * 1000 * opt.state[p]["sigma"][0] ** 2 * h[0]) == pytest.approx(0.950, abs=1e-3)
    est = run(opt, h, 2000)
    n = opt.num_steps
    torch.testing.assert_close(2 * n * opt.state[p]["sigma"] ** 2 * h, 1 / (1 + 1 / (2 * n * h * 0.01)),
                               rtol=2e-3, atol=0)
    floor = 1 / (2 * n * 0.1**2)
    torch.testing.assert_close(est - h, torch.full_like(h, floor), rtol=0.1, atol=0)
    torch.testing.assert_close(opt.curvature(debias=True).flat, h, rtol=2e-3, atol=1e-9)


def test_T6_exact_bgd_asymptotics():
    """Exact BGD: n sigma_n^2 H -> 1 (digest: 0.908 at n = 1e3); H_BGD = 1/(n sigma^2) has the floor
    1/(n sigma_0^2), removed by debias=True."""
    h = torch.tensor([1.0, 0.1, 0.01, 1e-3], dtype=DT)
    net = Vector(torch.zeros_like(h))
    opt = BGD(net.parameters(), model=net, sigma_init=0.1)
    p = opt.param_groups[0]["params"][0]
    run(opt, h, 1000)
    assert float(1000 * opt.state[p]["sigma"][0] ** 2) == pytest.approx(0.908, abs=2e-3)
    est = run(opt, h, 2000)
    n = opt.num_steps
    assert float(n * opt.state[p]["sigma"][0] ** 2) == pytest.approx(0.967, abs=2e-3)
    torch.testing.assert_close(est, h + 1 / (n * 0.01), rtol=5e-3, atol=0)
    torch.testing.assert_close(opt.curvature(debias=True).flat, h, rtol=2e-3, atol=0)


# ---------------------------------------------------------------- T7: BGD ~ MESU w/o reg ---------
def test_T7_bgd_equals_half_step_mesu_noreg_to_second_order():
    gen = torch.Generator().manual_seed(0)
    s = 0.01 + 0.2 * torch.rand(200, generator=gen, dtype=DT)
    x = (2 * torch.rand(200, generator=gen, dtype=DT) - 1) * 1e-2  # sigma * g_sigma in [-1e-2, 1e-2]
    g_sig = x / s
    net = Vector(torch.zeros(200, dtype=DT))
    bgd = BGD(net.parameters(), model=net)
    bgd.state[bgd.param_groups[0]["params"][0]]["sigma"].copy_(s)
    bgd.step(grads=MCGradients({"w": torch.zeros_like(s)}, {"w": g_sig}, torch.zeros(1, dtype=DT), {}))
    new_bgd = bgd.state[bgd.param_groups[0]["params"][0]]["sigma"]
    half = s - s**2 * g_sig / 2
    diff = (new_bgd - half).abs()
    assert bool((diff <= s * x**2 / 8 * (1 + 1e-6)).all())
    assert float(diff.max()) > 0  # the two rules do differ at second order
    net = Vector(torch.zeros(200, dtype=DT))
    noreg = MESUNoReg(net.parameters(), model=net)
    noreg.state[noreg.param_groups[0]["params"][0]]["sigma"].copy_(s)
    noreg.step(grads=MCGradients({"w": torch.zeros_like(s)}, {"w": g_sig / 2}, torch.zeros(1, dtype=DT), {}))
    torch.testing.assert_close(noreg.state[noreg.param_groups[0]["params"][0]]["sigma"], half)


# ---------------------------------------------------------------- T8: Proposition 1 -------------
@pytest.mark.parametrize("alpha0", [0.01, 0.3, 0.99])
def test_T8_proposition1_sequence(alpha0):
    a_lim = 0.1
    a = alpha0
    for _ in range(20000):
        a = a * (1 - a * a) / (1 - a_lim**2)
    assert a == pytest.approx(a_lim, rel=1e-6)


def test_T8_alpha_above_one_goes_nonpositive():
    a = 1.05
    assert a * (1 - a * a) / (1 - 0.1**2) <= 0
