"""BGD (Zeno et al. 2018; digest 000 section 4.1): the exact rule on real MC gradients, sigma stays
positive where MESU's rule would flip it, eta scales only the mean step, and the 1/(n sigma^2) estimate."""

from __future__ import annotations

import copy

import torch
from torch import nn

from curvkit.optim import BGD, MESUNoReg
from curvkit.posterior import MCGradients

DT = torch.float64




def test_bgd_step_is_zenos_exact_rule(make_mlp):
    X = torch.randn(8, 4, dtype=DT, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    model = make_mlp(activation="tanh")
    opt = BGD(model.parameters(), model=model, eta=3.0, sigma_init=0.07, mc_samples=3, seed=4)
    net = copy.deepcopy(model)
    g = BGD(net.parameters(), model=net, sigma_init=0.07, mc_samples=3, seed=4).mc_gradients(X, y)  # same noise as opt's step
    mu0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step(batch=(X, y))
    for n, p in model.named_parameters():
        s = torch.full_like(p, 0.07)
        torch.testing.assert_close(p.detach(), mu0[n] - 3.0 * s**2 * g.g_mu[n], rtol=1e-12, atol=1e-15)
        half = s * g.g_sigma[n] / 2
        torch.testing.assert_close(opt.sigma_dict()[n], s * torch.sqrt(1 + half**2) - s * half, rtol=1e-12, atol=1e-15)


def test_bgd_sigma_stays_positive_where_mesu_noreg_collapses():
    w = nn.Linear(3, 1, bias=False).to(DT)
    g_sig = torch.tensor([[10.0, 100.0, 1000.0]], dtype=DT)  # sigma * g_sigma = 1, 10, 100
    grads = MCGradients({"weight": torch.zeros_like(g_sig)}, {"weight": g_sig}, torch.zeros(1, dtype=DT), {})
    bgd = BGD(w.parameters(), model=w, sigma_init=0.1)
    bgd.step(grads=grads)
    assert bool((bgd.sigma_dict()["weight"] > 0).all())
    assert bgd.diagnostics["weights_large_sigma_grad"] == 3 and bgd.diagnostics["weights_nonpositive_sigma"] == 0
    net = copy.deepcopy(w)
    noreg = MESUNoReg(net.parameters(), model=net, sigma_init=0.1)
    noreg.step(grads=grads)
    assert noreg.diagnostics["weights_nonpositive_sigma"] == 3


def test_bgd_hessian_estimate_is_one_over_n_sigma_squared():
    w = nn.Linear(2, 1, bias=False).to(DT)
    opt = BGD(w.parameters(), model=w, sigma_init=0.1)
    for _ in range(4):
        s = opt.sigma_dict()["weight"]
        opt.step(grads=MCGradients({"weight": torch.zeros_like(s)}, {"weight": 2.0 * s},
                                   torch.zeros(1, dtype=DT), {}))
    s = opt.sigma_dict()["weight"]
    torch.testing.assert_close(opt.curvature().tensors[0], 1 / (4 * s**2))
    torch.testing.assert_close(opt.curvature(debias=True).tensors[0], (1 / s**2 - 100) / 4)
